"""Random BitNet b1.58 checkpoints of the 2B4T shape, packed and in bf16 with the same weights.

    bitnet_2b4t("packed")   # ~/.cache/orcaserve/random-bitnet-2b4t-packed: BitLinear, 2 bits a weight
    bitnet_2b4t("bf16")     # ~/.cache/orcaserve/random-bitnet-2b4t-bf16: the same model, plain bf16
    bitnet_2b4t("bf16", layers=4)  # random-bitnet-2b4t-l4-bf16: its first 4 layers, the full head
    bitnet_2b4t_gguf("TQ2_0", layers=4)  # random-bitnet-2b4t-l4.tq2_0.gguf, for llama.cpp
    bitnet_2b4t_gguf("TQ2_0", head="Q6_K")  # random-bitnet-2b4t.tq2_0-q6_k.gguf: llama-quantize's
    bitnet_2b4t_twin("Q6_K")  # random-bitnet-2b4t-bf16-q6_k: its bf16 twin, the head dequantized

The shape is microsoft/bitnet-b1.58-2B-4T's (hidden 2560, 30 layers, 20 heads over 5 KV heads, MLP
6912, vocab 128256, ReLU^2), with tied embeddings as llama.cpp's bitnet files have them. Codes are
uniform over {-1, 0, +1}, each projection's weight scale a power of two, so `t / weight_scale` is
exact in bf16: the bf16 checkpoint (no quantization config: plain float projections, served like
any lean model) holds the same weights. Built a tensor at a time (one safetensors shard per layer),
never the model in floats; the tokenizer is SmolLM2's grown to the head's 128256 tokens
(benchmarks/models/vocab.py), which llama.cpp needs in the GGUF to load the file at all.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from orcaserve.bench.models.vocab import vocab_gguf

SHAPE: dict[str, Any] = dict(
    hidden_size=2560,
    intermediate_size=6912,
    num_hidden_layers=30,
    num_attention_heads=20,
    num_key_value_heads=5,
    vocab_size=128256,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
_PROJ = {  # name -> (out, in)
    "self_attn.q_proj": ("hidden_size", "hidden_size"),
    "self_attn.o_proj": ("hidden_size", "hidden_size"),
    "mlp.gate_proj": ("intermediate_size", "hidden_size"),
    "mlp.up_proj": ("intermediate_size", "hidden_size"),
    "mlp.down_proj": ("hidden_size", "intermediate_size"),
}


def _layer(i: int, packed: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from transformers.integrations.bitnet import pack_weights

    h, kv = SHAPE["hidden_size"], SHAPE["hidden_size"] // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    shapes = {k: (SHAPE[o], SHAPE[n]) for k, (o, n) in _PROJ.items()}
    shapes["self_attn.k_proj"] = shapes["self_attn.v_proj"] = (kv, h)
    out: dict[str, torch.Tensor] = {}
    p = f"model.layers.{i}."
    for name, shape in sorted(shapes.items()):
        t = torch.randint(-1, 2, shape, generator=gen, dtype=torch.int8)
        scale = torch.tensor([2.0 ** int(torch.randint(2, 6, (1,), generator=gen))])
        if packed:
            out[p + name + ".weight"] = pack_weights(t)
            out[p + name + ".weight_scale"] = scale
        else:
            out[p + name + ".weight"] = (t.float() / scale).bfloat16()
    for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h)):
        out[p + norm + ".weight"] = torch.ones(size, dtype=torch.bfloat16)
    out[p + "self_attn.attn_sub_norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out[p + "mlp.ffn_sub_norm.weight"] = torch.ones(SHAPE["intermediate_size"], dtype=torch.bfloat16)
    return out


def bitnet_2b4t(kind: str = "packed", out: str | None = None, layers: int | None = None) -> str:
    """The cached checkpoint's directory ("packed" or "bf16"), built first if missing; `layers`: a
    scaled shape, the first `layers` layers of the full one (the same draws) and an embedding of
    the same shape, where the full shape is too slow to measure."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BitNetConfig

    shape = {**SHAPE, "num_hidden_layers": layers or SHAPE["num_hidden_layers"]}
    name = f"random-bitnet-2b4t-{kind}" if layers is None else f"random-bitnet-2b4t-l{layers}-{kind}"
    out = out or os.path.join(os.path.expanduser("~/.cache/orcaserve"), name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)  # the same draws for both kinds: the same weights
    shards = shape["num_hidden_layers"] + 1
    index: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        if i < shape["num_hidden_layers"]:
            tensors = _layer(i, kind == "packed", gen)
        else:
            embed = torch.randn(SHAPE["vocab_size"], SHAPE["hidden_size"], generator=gen) * 0.02
            tensors = {"model.embed_tokens.weight": embed.bfloat16()}
            tensors["model.norm.weight"] = torch.ones(SHAPE["hidden_size"], dtype=torch.bfloat16)
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    raw = BitNetConfig(**shape).to_dict()
    raw["architectures"] = ["BitNetForCausalLM"]
    raw["torch_dtype"] = "bfloat16"
    if kind == "packed":
        raw["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear"}
        raw["quantization_config"]["quantization_mode"] = "offline"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    vocab = vocab_gguf(SHAPE["vocab_size"])
    AutoTokenizer.from_pretrained(os.path.dirname(vocab), gguf_file=os.path.basename(vocab)).save_pretrained(out)
    return out


def bitnet_2b4t_gguf(qtype: str = "TQ2_0", layers: int | None = None, head: str | None = None) -> str:
    """The packed checkpoint as a `qtype` GGUF beside it (cached), written as llama.cpp's converter
    writes `--outtype tq1_0 / tq2_0`: tied, the embedding in F16, with the grown tokenizer. `head`
    (Q6_K, Q8_0): that file through llama.cpp's `llama-quantize ... qtype`, which keeps the TQ
    tensors as they are and writes the tied embedding (its output tensor) as Q6_K by default, or
    in `--output-tensor-type` (benchmarks/peers/setup_llamacpp.sh builds it)."""
    from orcaserve.bench.models.bitnet_gguf import write_bitnet_gguf

    source = bitnet_2b4t("packed", layers=layers)
    out = f"{source.removesuffix('-packed')}.{qtype.lower()}.gguf"
    if not os.path.exists(out):
        vocab = vocab_gguf(SHAPE["vocab_size"])
        write_bitnet_gguf(source, out + ".part", qtype, tied=True, tokenizer_from=vocab, embed="F16")
        os.replace(out + ".part", out)
    return out if head is None else _llama_quantized(out, qtype, head)


def _llama_quantized(source: str, qtype: str, head: str) -> str:
    import subprocess

    from orcaserve.bench.peers.llamacpp import llamacpp_env
    from orcaserve.bench.peers.models import QUANTIZE

    out = f"{source.removesuffix('.gguf')}-{head.lower()}.gguf"
    if not os.path.exists(out):
        flags = [] if head == "Q6_K" else ["--output-tensor-type", head.lower()]  # Q6_K: its default
        cmd = [str(QUANTIZE), *flags, source, out + ".part", qtype]
        subprocess.run(cmd, env=llamacpp_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(out + ".part", out)
    return out


def bitnet_2b4t_twin(head: str, layers: int | None = None) -> str:
    """The bf16 checkpoint of `bitnet_2b4t_gguf("TQ2_0", layers, head)`'s weights: the bf16
    checkpoint's layers (linked), its embedding (the tied head) the file's `head` blocks
    dequantized and rounded to bf16 (cached)."""
    import shutil

    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from safetensors.torch import save_file

    from orcaserve.scheduler.model.gguf_header import read_gguf, tensor_bytes

    dense = bitnet_2b4t("bf16", layers=layers)
    out = f"{dense}-{head.lower()}"
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    path = bitnet_2b4t_gguf("TQ2_0", layers=layers, head=head)
    _, header = read_gguf(path)
    info = next(t for t in header.tensors if t.name == "token_embd.weight")
    kind = GGMLQuantizationType(info.ggml_type)
    raw = tensor_bytes(np.memmap(path, mode="r", dtype=np.uint8), header, info).reshape(info.shape[0], -1)
    embed = torch.from_numpy(dequantize(raw, kind)).bfloat16()
    with open(os.path.join(dense, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"]["model.embed_tokens.weight"]
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(dense):
        if name.endswith(".safetensors") and name != shard:
            os.symlink(os.path.join(dense, name), os.path.join(out, name))
        elif name != shard and name != "config.json":
            shutil.copy(os.path.join(dense, name), os.path.join(out, name))
    norm = torch.ones(SHAPE["hidden_size"], dtype=torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, os.path.join(out, shard))
    shutil.copy(os.path.join(dense, "config.json"), os.path.join(out, "config.json"))  # last: the cache mark
    return out

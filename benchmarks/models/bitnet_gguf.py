"""A packed BitNet checkpoint written as a ternary GGUF (TQ1_0 or TQ2_0) with gguf-py's writer and
quantize functions, under the names and metadata keys llama.cpp's converter writes for `bitnet`.

    write_bitnet_gguf(checkpoint_dir, "model.tq2_0.gguf", "TQ2_0")

Why not llama.cpp's converter (convert_hf_to_gguf.py, class BitnetModel): it dequantizes a packed
projection to `t / weight_scale` and then requantizes it with the scale `mean(|w|)`, which is the
source's `1 / weight_scale` times the tensor's fraction of nonzero weights: its file holds another
model (each projection scaled by that fraction) than the checkpoint. Here a projection is written
as gguf-py quantizes `t / weight_scale` in fp32: every block's `d` is `fp16(1 / weight_scale)`, so
a checkpoint whose scales round-trip (1 / fp16(1 / s) == s, e.g. powers of two) reads back bit for
bit. The converter also needs a SentencePiece tokenizer.model, which the tiny models have not.
Norms are written in F32, embeddings in F32 (the checkpoint's floats exactly) or, with `embed="F16"`,
in F16 as the converter writes them beside TQ projections; `tied` drops lm_head.weight as
llama.cpp's bitnet tensor list has no output tensor. `head="Q6_K"` (or Q8_0) writes the output
tensor, or the tied embedding, in that block type, as llama-quantize writes a TQ file's head.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch

# transformers parameter suffix -> llama.cpp tensor name suffix, per layer
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.attn_sub_norm.weight": "attn_sub_norm.weight",
    "mlp.ffn_sub_norm.weight": "ffn_sub_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP["lm_head.weight"] = "output.weight"
_EMBED = {"F32": np.float32, "F16": np.float16}  # embedding types written


def gguf_name(key: str) -> str:
    if key in _TOP:
        return _TOP[key]
    _, _, rest = key.partition("model.layers.")
    layer, _, tail = rest.partition(".")
    return f"blk.{layer}.{_LAYER[tail]}"


def write_bitnet_gguf(
    checkpoint: str,
    out: str,
    qtype: str = "TQ2_0",
    tied: bool = False,
    tokenizer_from: str | None = None,
    embed: str = "F32",
    head: str | None = None,
) -> str:
    """`checkpoint` (a packed BitNet directory: config.json, model.safetensors) as a GGUF at `out`,
    its projections in `qtype` (TQ1_0, TQ2_0, or F32: the floats, for the refusal test), its
    embeddings in `embed` (F32 or F16), the lm_head (output, or the tied embedding) in `head` where
    given (Q6_K, Q8_0); `tokenizer_from`: a GGUF whose tokenizer metadata is copied
    in (none otherwise; llama.cpp loads the file only where its token list has the head's rows:
    benchmarks/models/vocab.py)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType
    from gguf.quants import quantize
    from safetensors import safe_open

    from orcaserve.kernels.ternary import unpack_ternary

    kind = GGMLQuantizationType[qtype]
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    writer = GGUFWriter(out, "bitnet")
    heads = cfg["num_attention_heads"]
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", 500000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_scaling_type(RopeScalingType.LINEAR)  # as the converter's BitnetModel writes
    writer.add_rope_scaling_factor(1.0)
    writer.add_file_type(LlamaFileType.ALL_F32 if qtype == "F32" else LlamaFileType[f"MOSTLY_{qtype}"])
    for key, field in GGUFReader(tokenizer_from).fields.items() if tokenizer_from else ():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for file in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        with safe_open(file, framework="pt") as tensors:
            keys = [k for k in tensors.keys() if not k.endswith(".weight_scale")]
            for key in keys:
                if tied and key == "lm_head.weight":
                    continue
                w = tensors.get_tensor(key)
                if w.dtype == torch.uint8:  # packed ternary: t / weight_scale in fp32, quantized
                    scale = tensors.get_tensor(key + "_scale").float()
                    t = unpack_ternary(w).float()
                    dense = (t / scale).numpy()
                    if kind == GGMLQuantizationType.F32:  # a float file, as `--outtype f32` writes
                        writer.add_tensor(gguf_name(key), dense)
                    else:
                        writer.add_tensor(gguf_name(key), quantize(dense, kind), raw_dtype=kind)
                elif head and key == ("model.embed_tokens.weight" if tied else "lm_head.weight"):
                    writer.add_tensor(
                        gguf_name(key), _blocks(w.float().numpy(), head), raw_dtype=GGMLQuantizationType[head]
                    )
                elif key in _TOP and w.dim() == 2:  # token_embd, output
                    writer.add_tensor(gguf_name(key), w.float().numpy().astype(_EMBED[embed]))
                else:
                    writer.add_tensor(gguf_name(key), w.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _blocks(w: np.ndarray, qtype: str) -> np.ndarray:
    """[N, K] fp32 as `qtype` blocks: gguf-py's quantizer, or q6_k.py's for Q6_K (gguf-py has none)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from orcaserve.bench.models.q6_k import quantize_q6_k

    return quantize_q6_k(w) if qtype == "Q6_K" else quantize(w, GGMLQuantizationType[qtype])

"""BitNet b1.58 from llama.cpp's ternary GGUF files, TQ1_0 and TQ2_0 (docs/bitnet.md, "GGUF files").

transformers does not read a GGUF of architecture `bitnet`; this module builds the same
`BitNetForCausalLM` its loader builds from a packed checkpoint, each projection a `BitLinear`
(codes packed four to a byte, one `weight_scale`), so that everything after the load (the checks,
the lean decoder's `TernaryLinear`, the C++ kernel's packing) is the checkpoint's path.

A TQ block holds 256 weights of one row, codes in {-1, 0, +1} and its own fp16 scale `d`: the
weight is `d * code`. BitNet's arithmetic has one scale per tensor, `y = linear(x_q, t) /
(weight_scale * s)`, so a tensor is served only if every block with a nonzero code carries the
same finite, positive `d`; its `weight_scale` is then `1 / d` in fp32, and the served model is bit
for bit transformers' fp32 forward of the packed checkpoint with those codes and scales. The header
is read lean (`gguf_header.read_gguf`: the vocabulary is not parsed), the tensors from a memory map
one at a time, their blocks decoded in integers straight into transformers' packing
(`ternary_blocks.py`): no ternary weight is ever a float. A TQ2_0 code of 3 (the value 2), differing
scales within a tensor, or a projection of any other type is refused with the tensor's name.

With `quantization="gguf"` the lm_head is served in the file's own block format where it has one
(llama.cpp's `llama-quantize` writes a TQ file's output tensor, or its tied embedding, as Q6_K):
its blocks are attached as codes (quantized.py), verified to dequantize to the loaded weight bit
for bit, and the decoder runs it as a `QuantLinear` (docs/bitnet.md, "A quantized lm_head").
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from orcaserve.kernels.quant import BlockCodes
from orcaserve.scheduler.model.gguf_blocks import FORMATS, as_gguf_py_reads, parse_blocks, takes_width, verified
from orcaserve.scheduler.model.gguf_header import read_gguf, tensor_bytes
from orcaserve.scheduler.model.quantized import QUANTIZED, attach
from orcaserve.scheduler.model.stream_load import put_tensor
from orcaserve.scheduler.model.ternary_blocks import BLOCK, SIZES, block_scales, pack_rows, unsigned_codes

log = logging.getLogger(__name__)

ARCHITECTURE = "bitnet"  # general.architecture as llama.cpp's converter writes it
TERNARY = ("TQ1_0", "TQ2_0")

# bitnet.<key> -> BitNetConfig field (llama.cpp's metadata keys, gguf-py's Keys)
_CONFIG = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKENS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
_ROPE_THETA = 10000.0  # llama.cpp's freq_base where the file has none

# GGUF tensor name (blk.N. stripped) -> transformers parameter (model.layers.N. stripped)
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_sub_norm.weight": "self_attn.attn_sub_norm.weight",
    "ffn_sub_norm.weight": "mlp.ffn_sub_norm.weight",
    "attn_q.weight": "self_attn.q_proj",
    "attn_k.weight": "self_attn.k_proj",
    "attn_v.weight": "self_attn.v_proj",
    "attn_output.weight": "self_attn.o_proj",
    "ffn_gate.weight": "mlp.gate_proj",
    "ffn_up.weight": "mlp.up_proj",
    "ffn_down.weight": "mlp.down_proj",
}


def _field(metadata: dict[str, Any], key: str) -> Any:
    """A metadata value; an fp32 as its shortest decimal (1e-05, not 9.99999974e-06), as a config
    file would hold it: the same fp32 wherever the model computes with it."""
    value = metadata.get(key)
    return float(str(np.float32(value))) if isinstance(value, float) else value


def bitnet_config(metadata: dict[str, Any], header: Any) -> Any:
    """The BitNetConfig a `bitnet` GGUF's metadata and tensor table (`gguf_header.read_gguf`)
    describe; raises ValueError where the lean decoder would compute another model (another head
    size or rope scaling)."""
    from transformers import BitNetConfig

    arch = _field(metadata, "general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"general.architecture is {arch!r}, not {ARCHITECTURE!r}")
    values: dict[str, Any] = {}
    for key, name in _CONFIG.items():
        value = _field(metadata, f"{ARCHITECTURE}.{key}")
        if value is not None:
            values[name] = value
    shapes = {t.name: t.shape for t in header.tensors}  # torch order: [rows, columns]
    if "vocab_size" not in values:  # older converters write no vocab_size: the embedding's rows
        values["vocab_size"] = int(shapes["token_embd.weight"][0])
    for key, name in _TOKENS.items():
        values[name] = _field(metadata, f"tokenizer.ggml.{key}")
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    rot = _field(metadata, f"{ARCHITECTURE}.rope.dimension_count")
    if rot is not None and rot != hidden // heads:
        raise ValueError(f"rope.dimension_count {rot} is not the head size {hidden // heads}: not served")
    scaling = _field(metadata, f"{ARCHITECTURE}.rope.scaling.type")
    factor = _field(metadata, f"{ARCHITECTURE}.rope.scaling.factor")
    if scaling not in (None, "none", "linear") or (scaling == "linear" and factor not in (None, 1.0)):
        raise ValueError(f"rope scaling {scaling!r} (factor {factor}) is not served for BitNet")
    theta = _field(metadata, f"{ARCHITECTURE}.rope.freq_base")
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta or _ROPE_THETA)}
    values["tie_word_embeddings"] = "output.weight" not in shapes
    config = BitNetConfig(**values)
    config.architectures = ["BitNetForCausalLM"]
    return config


def ternary_codes(name: str, raw: np.ndarray, kind: Any, shape: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """([ceil(N/4), K] uint8 codes packed as transformers packs them, d) of a TQ1_0 / TQ2_0 tensor
    `name` of `shape` [N, K] (raw: its blocks' bytes), decoded in integers (ternary_blocks.py);
    raises ValueError naming the tensor where it is not one scale times {-1, 0, +1}."""
    n, k = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n * k // BLOCK, SIZES[kind.name])
    unsigned = unsigned_codes(blocks, kind.name)  # [blocks, 256]: code + 1
    if unsigned.max() > 2:  # TQ2_0's code 3; a bound, not np.isin
        raise ValueError(f"{name}: a {kind.name} code outside {{-1, 0, +1}}: not a ternary weight")
    d = block_scales(blocks)
    live = d[(unsigned != 1).any(axis=1)]  # blocks with a nonzero code
    scale = float(live[0]) if live.size else 1.0  # an all-zero tensor: any scale gives 0
    if live.size and (not np.all(live == live[0]) or not np.isfinite(scale) or scale <= 0):
        found = np.unique(live)[:4].tolist()
        raise ValueError(
            f"{name}: its {kind.name} blocks carry scales {found}{' ...' if np.unique(live).size > 4 else ''}; "
            "BitNet serves one finite positive scale per tensor"
        )
    return torch.from_numpy(pack_rows(unsigned.reshape(n, k))), scale


def _parameter(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    head, _, rest = name.partition(".")
    layer, _, tail = rest.partition(".")
    if head != "blk" or not layer.isdigit() or tail not in _LAYER:
        raise ValueError(f"{name}: no tensor of that name in a BitNet model")
    return f"model.layers.{layer}.{_LAYER[tail]}"


def head_format(path: str) -> str | None:
    """The BlockCodes format of a `bitnet` GGUF's lm_head (its output tensor, else the tied
    embedding) where the file holds it in a block type with a packed GEMM; None for F16 / F32."""
    from gguf import GGMLQuantizationType

    _, header = read_gguf(path)
    types = {t.name: GGMLQuantizationType(t.ggml_type).name for t in header.tensors}
    return FORMATS.get(types.get("output.weight") or types.get("token_embd.weight", ""))


def head_codes(name: str, raw: np.ndarray, kind: Any, w: torch.Tensor) -> BlockCodes | None:
    """The lm_head's codes from its tensor `name` (raw: its blocks as gguf-py reads them, w: their
    fp32 dequantization), or None (logged) where the file's type has no packed GEMM."""
    fmt = FORMATS.get(kind.name)
    if fmt is None or not takes_width(fmt, w.shape[1]):
        log.warning("%s is %s: the lm_head is served dense", name, kind.name)
        return None
    codes = verified(parse_blocks(raw, fmt, w.shape[1]), w)
    if codes is None:
        log.warning("%s: its %s blocks do not reproduce it bit for bit: the lm_head is served dense", name, kind.name)
    return codes


def load_bitnet_gguf(path: str, quantization: str | None = None) -> Any:
    """The BitNetForCausalLM of a `bitnet` GGUF at `path`, on the CPU: projections as BitLinear
    (packed codes, weight_scale = 1 / d in fp32), the rest in fp32 as gguf-py dequantizes it. With
    `quantization="gguf"`, the lm_head also keeps the file's blocks as codes where it has a block
    type (the model is then marked loaded with quantization "gguf"); other modes are left to the
    engine's check, which refuses them."""
    from accelerate import init_empty_weights
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import BitLinear

    metadata, header = read_gguf(path)
    config = bitnet_config(metadata, header)
    with init_empty_weights():
        model = BitNetForCausalLM(config)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    codes: BlockCodes | None = None
    for info in header.tensors:
        key = _parameter(info.name)
        kind, raw = GGMLQuantizationType(info.ggml_type), tensor_bytes(blob, header, info)
        if key.endswith("_proj"):  # a ternary projection, a BitLinear of the packed checkpoint
            if kind.name not in TERNARY or len(info.shape) != 2:
                raise ValueError(f"{info.name} is {kind.name}: a BitNet GGUF's projections are TQ1_0 or TQ2_0")
            n, k = info.shape  # [N, K]
            packed, d = ternary_codes(info.name, raw, kind, (n, k))
            layer = BitLinear(k, n, bias=False, dtype=torch.float32)
            layer.weight.copy_(packed)  # [N/4, K] uint8, transformers' packing
            layer.weight_scale.fill_(1.0 / d)  # fp32
            owner, _, attr = key.rpartition(".")
            setattr(model.get_submodule(owner), attr, layer)
            continue
        data = as_gguf_py_reads(raw, kind, info.shape)
        w = torch.from_numpy(np.array(gguf_dequantize(data, kind), dtype=np.float32)).reshape(info.shape)  # a copy
        put_tensor(model, key, w)
        if quantization == "gguf" and info.name == head:
            codes = head_codes(info.name, data, kind, w)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quantization == "gguf":  # the embedding stays dense (read by row); only the head's tie is cut
        if codes is not None:
            attach(model.lm_head, codes)
            log.info("BitNet GGUF %s: the lm_head served from %s's %s blocks", path, head, codes.fmt)
        setattr(model, QUANTIZED, "gguf")
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path} has no tensor for {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}")
    model.generation_config.eos_token_id = config.eos_token_id
    log.info("BitNet GGUF %s: %d layers of ternary projections", path, config.num_hidden_layers)
    return model.eval()

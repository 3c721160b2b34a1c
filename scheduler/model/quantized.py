"""Quantized linear weights for the lean decoder (docs/serving.md "Quantized weights").

At load, each projection of a Llama-family model (q/k/v/o, gate/up/down, lm_head) gets the block
codes (`orcaserve.kernels.quant.BlockCodes`) it is served from, attached to its `nn.Linear` as
`orcaserve_codes`, and its fp32 weight is freed; the decoder then builds `QuantLinear`s over them
(`fused_linear`). Codes come from:
- "gguf": the file's own Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks (gguf_blocks.py), matched to the modules by content;
- "int8"/"int4": quantizing the loaded weights (q8_0; q4_1 for the layers and q8_0 for the lm_head).
A module without codes keeps its weight in the model's dtype, as without quantization.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from orcaserve.kernels.linear import Linear, fuse_linears
from orcaserve.kernels.quant import BlockCodes, QuantLinear, QuantLinearGroup, concat, dequantize, quantize

log = logging.getLogger(__name__)

CODES = "orcaserve_codes"  # the nn.Linear attribute that holds a module's BlockCodes
ACTIVATIONS = "orcaserve_activations"  # the nn.Linear attribute: QuantLinear's `activations` ("int8")
GGUF_PATH = "orcaserve_gguf_path"  # the model attribute the loader sets to the .gguf it read
QUANTIZED = "orcaserve_quantized"  # the model attribute naming the mode a streamed load applied
_QUANT_ROWS = 8192  # rows quantized at once (quantize_for): bounds the fp32 temporaries
# Bytes per 32 weights as served: a GGUF block (fp16 scale, + fp16 min, + the codes) for the first
# three; the K-quants as the packed GEMM holds them, fp32 scale (+ min) per 32 (q6_k: per 16) and
# 4- or 8-bit codes: 6 and 10 bits a weight, against the file's 4.5 and 6.5625.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 24, "q6_k": 40}
# int4's block format: q4_1 (a scale and a min per block, 20 bytes a block against q4_0's 18), by
# the quality table of docs/performance-log.md "Quantized weights: load, quality and decode speed". Its
# lm_head (often tied to the embedding, and the layer whose error reaches the logits unmixed)
# stays q8_0, as llama.cpp's Q4 files keep their output tensor at 6-8 bits.
MODE_FORMATS = {"int8": ("q8_0", "q8_0"), "int4": ("q4_1", "q8_0")}  # (layers, lm_head)
_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def linears(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, module) of every projection the lean decoder runs, the lm_head last."""
    for i, layer in enumerate(model.model.layers):
        for proj in _PROJECTIONS:
            module = layer.get_submodule(proj)
            yield f"model.layers.{i}.{proj}", module
    yield "lm_head", model.lm_head


def attach(module: torch.nn.Module, codes: BlockCodes) -> None:
    """Serve `module` from `codes`: its dense weight is dropped (the codes reproduce it)."""
    setattr(module, CODES, codes)
    module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def codes_bytes(codes: BlockCodes) -> int:
    """The bytes `codes` take as served (BLOCK_BYTES; the packed GEMM's may add padding)."""
    n, k = codes.q.shape
    return n * (k // 32) * BLOCK_BYTES[codes.fmt]


def quantize_model(model: Any, mode: str, dtype: torch.dtype) -> None:
    """Attach codes for `mode` ("gguf", "int8", "int4") to `model`'s projections, free the dense
    copies, and log what is quantized how and the linear weights' bytes before and after (dense
    bytes counted in `dtype`, what the model would hold without quantization). The model's
    weights should be fp32 here: "gguf" matches them bit for bit to the file's blocks. A model the
    loader already filled quantized (stream_load.py, docs/serving.md "Memory at load") is left as
    it is: its codes came from the same fp32 values, and its log line was written then."""
    done = getattr(model, QUANTIZED, None)
    if done is not None:
        if done != mode:
            raise ValueError(f"the model was loaded with quantization={done!r}, not {mode!r}")
        return
    named: list[tuple[str, Any]] = [
        (name, module) for name, module in linears(model) if getattr(module, CODES, None) is None
    ]
    if mode == "gguf":
        from orcaserve.scheduler.model.gguf_blocks import match_gguf_blocks

        path = getattr(model, GGUF_PATH, None)
        if path is None:
            raise ValueError("quantization 'gguf' needs a model loaded from a .gguf file")
        found = match_gguf_blocks(path, named)
    elif mode in MODE_FORMATS:
        found = {name: quantize_for(mode, name, module.weight.detach()) for name, module in named}
    else:
        raise ValueError(f"unknown quantization {mode!r}")
    rows = []
    for name, module in named:
        codes = found.get(name)
        rows.append((name, module.weight.numel(), codes))
        if codes is not None:
            attach(module, codes)
    log_quantized(mode, dtype, rows)


def mark_activations(model: Any, activations: str | None) -> None:
    """Have the decoder's QuantLinears over `model`'s codes take `activations` (None: the bitwise
    fp32 GEMM; "int8": docs/int8-activations.md)."""
    for _, module in linears(model):
        if getattr(module, CODES, None) is not None:
            setattr(module, ACTIVATIONS, activations)


def quantize_for(mode: str, name: str, w: torch.Tensor) -> BlockCodes | None:
    """The codes `mode` ("int8"/"int4") gives projection `name`'s weight, None where K is not a
    multiple of 32. Quantized a slice of rows at a time, each upcast to fp32 on its own: blocks
    are rows' own, so the codes are those of the whole weight at once, without an fp32 copy of it."""
    layer_fmt, head_fmt = MODE_FORMATS[mode]
    if w.shape[1] % 32:
        return None
    fmt = head_fmt if name == "lm_head" else layer_fmt
    parts = [quantize(w[i : i + _QUANT_ROWS].float(), fmt) for i in range(0, w.shape[0], _QUANT_ROWS)]
    return parts[0] if len(parts) == 1 else concat(parts)


def log_quantized(mode: str, dtype: torch.dtype, rows: list[tuple[str, int, BlockCodes | None]]) -> None:
    """The load's one line: (name, weight elements, codes or None for dense) of each projection."""
    width = torch.finfo(dtype).bits // 8
    before = after = 0
    kinds: dict[str, int] = {}
    dense: list[str] = []
    for name, numel, codes in rows:
        before += numel * width
        if codes is None:
            after += numel * width
            dense.append(name)
            continue
        after += codes_bytes(codes)
        kinds[codes.fmt] = kinds.get(codes.fmt, 0) + 1
    what = ", ".join(f"{n} as {fmt}" for fmt, n in sorted(kinds.items())) or "none"
    log.warning(
        "quantization=%s: %d linear weights served quantized (%s), %d dense in %s%s; linear weight bytes "
        "%.1f MB in %s -> %.1f MB",
        mode,
        sum(kinds.values()),
        what,
        len(dense),
        str(dtype).removeprefix("torch."),
        f" ({', '.join(dense[:8])}{', ...' if len(dense) > 8 else ''})" if dense else "",
        before / 1e6,
        str(dtype).removeprefix("torch."),
        after / 1e6,
    )


def head_linear(model: Any, pack: bool, dtype: torch.dtype) -> Linear | QuantLinear:
    """The lm_head's GEMM: from its codes where it has them, else packed apart from the embedding
    even when tied (both are read: the embedding by row, the head as a GEMM)."""
    head = model.lm_head
    if hasattr(head, CODES):
        return fused_linear(head, pack=pack, dtype=dtype)
    return Linear(head.weight, getattr(head, "bias", None), pack)


def fused_linear(*modules: Any, pack: bool, dtype: torch.dtype, plain_from: int | None = None) -> Linear | QuantLinear:
    """The decoder's GEMM over the concatenated outputs of `modules`: a QuantLinear when every one
    has codes of one format, a QuantLinearGroup (one per run of a format) when every one has codes
    in mixed formats (Q4_K_M's Q6_K attn_v beside Q4_K q/k), else `fuse_linears` over dense weights
    (codes that cannot join their group are dequantized back, exactly the loaded weights, in `dtype`)."""
    codes: list[BlockCodes | None] = [getattr(m, CODES, None) for m in modules]
    activations = getattr(modules[0], ACTIVATIONS, None)
    for m in modules:
        for attr in (CODES, ACTIVATIONS):
            if hasattr(m, attr):
                delattr(m, attr)
    present = [c for c in codes if c is not None]
    if present and len(present) == len(codes):
        biases = [m.bias for m in modules]
        runs: list[tuple[BlockCodes, torch.Tensor | None]] = []
        for _, group in itertools.groupby(zip(present, biases), key=lambda cb: cb[0].fmt):
            members = list(group)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b if b is not None else torch.zeros(c.q.shape[0], dtype=dtype) for c, b in members])
            runs.append((concat([c for c, _ in members]) if len(members) > 1 else members[0][0], bias))
        for m in modules:
            m.bias = None
        if len(runs) == 1:
            return QuantLinear(*runs[0], activations=activations)
        return QuantLinearGroup(runs, activations=activations)
    for m, c in zip(modules, codes):
        if c is not None:
            log.warning("a fused group mixes codes and dense weights: its %s codes are served dense", c.fmt)
            m.weight = torch.nn.Parameter(dequantize(c).to(dtype), requires_grad=False)
    return fuse_linears(*modules, pack=pack, plain_from=plain_from)

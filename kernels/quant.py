"""GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) served quantized: the codes, their
exact dequantization, llama.cpp's reference quantizers (of the first three), and `QuantLinear`, the
lean decoder's linear layer over a weight that stays in its block format (docs/kernels.md,
"Quantized GEMM on the CPU").

Formats as GGUF / llama.cpp define them: blocks of GROUP = 32 consecutive input-dim (K) elements
of one output row, each with a scale `d` (fp16 in the file) and for q4_1 a min `m`:
- q8_0: codes int8 in [-128, 127], w = d * q
- q4_0: codes in [-8, 7] (the file stores the nibble q + 8), w = d * q
- q4_1: codes in [0, 15], w = d * q + m
- q4_k: as q4_1 per 32 elements, with the K-quant's fp32 products as scale and min: d = fp32(d) *
  sc and m = -(fp32(dmin) * mn) of the 256-element super-block's fp16 d, dmin and 6-bit sc, mn
  (gguf-py computes d * q - dmin * mn; a - b == a + (-b) exactly)
- q6_k: codes in [-32, 31], w = d * q, a scale fp32(d) * sc (int8 sc) per 16 elements
The dequantized weight is gguf-py's: fp32(d) * fp32(q), then + fp32(m), two roundings (never a
fused multiply-add). The C++ GEMM (`kernels/cpu/csrc/gemm/gemm_quant.cpp`) widens codes to
exactly these fp32 weights and sums like the project's fp32 GEMM, so its results are bit for bit
that GEMM's on `dequantize(codes)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch import int8_activations

FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
QUANTIZERS = ("q8_0", "q4_0", "q4_1")  # the formats `quantize` makes
GROUP = 32
SPAN = {"q6_k": 16}  # elements per scale where not GROUP
OFFSET = ("q4_1", "q4_k")  # the formats with a min per block
WIDE = ("q4_k", "q6_k")  # packed with fp32 scales: theirs are fp32 products, not fp16 values
_RANGE = {"q8_0": (-128, 127), "q4_0": (-8, 7), "q4_1": (0, 15), "q4_k": (0, 15), "q6_k": (-32, 31)}
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q6_k": 8}  # code width in the packed blocks


@dataclass(frozen=True)
class BlockCodes:
    """One [N, K] weight in a block format, unpacked."""

    fmt: str
    q: torch.Tensor  # int8 [N, K], codes in the format's range
    scale: torch.Tensor  # fp32 [N, K // span] (fp16 values, but for the K-quants' fp32 products)
    offset: torch.Tensor | None  # fp32 [N, K // 32] for q4_1 and q4_k, else None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown block format {self.fmt!r}: expected one of {', '.join(FORMATS)}")
        n, k = self.q.shape
        if self.q.dtype != torch.int8 or k % GROUP:
            raise ValueError(f"codes must be int8 [N, K] with K a multiple of {GROUP}, got {self.q.dtype} {n}x{k}")
        span = SPAN.get(self.fmt, GROUP)
        if self.scale.shape != (n, k // span) or self.scale.dtype != torch.float32:
            raise ValueError(f"scale must be fp32 [{n}, {k // span}], got {self.scale.dtype} {tuple(self.scale.shape)}")
        if (self.offset is not None) != (self.fmt in OFFSET):
            raise ValueError(f"{self.fmt}: an offset (min) is given for {' and '.join(OFFSET)} only, and needed")
        if self.offset is not None and (self.offset.shape != self.scale.shape or self.offset.dtype != torch.float32):
            raise ValueError("offset must be fp32 and shaped as scale")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])


def dequantize(codes: BlockCodes) -> torch.Tensor:
    """fp32 [N, K]: d * q (+ m), in gguf-py's arithmetic, bit for bit."""
    n, k = codes.shape
    span = SPAN.get(codes.fmt, GROUP)
    w = codes.scale.unsqueeze(-1) * codes.q.view(n, k // span, span).float()
    if codes.offset is not None:
        w = w + codes.offset.unsqueeze(-1)  # a separate add: torch never fuses it into an FMA
    return w.reshape(n, k)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """A scale as the file stores it: rounded to fp16 (to nearest even, as GGML_FP32_TO_FP16)."""
    return x.half().float()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d in fp32, 0 where d is 0 (llama.cpp's `id = d ? 1.0f/d : 0.0f`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: torch.round rounds halves to even, and
    floor(|x| + 0.5) can round up in the add."""
    t = torch.trunc(x)
    return torch.where((x - t).abs() >= 0.5, t + torch.sign(x), t)


def quantize(w: torch.Tensor, fmt: str) -> BlockCodes:
    """[N, K] fp32/bf16 (K a multiple of 32) -> codes, as llama.cpp's reference quantizers
    (quantize_row_q8_0_ref, q4_0_ref, q4_1_ref) compute them in fp32: the scale from the unrounded
    block statistics, codes from its unrounded inverse, the scale (and min) then rounded to fp16."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"no quantizer for block format {fmt!r}: expected one of {', '.join(QUANTIZERS)}")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"K = {k} is not a multiple of {GROUP}")
    x = w.float().reshape(n, k // GROUP, GROUP)
    offset = None
    if fmt == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        q = _roundf(x * _inverse(d))
    elif fmt == "q4_0":  # the signed value of largest magnitude (its first occurrence) maps to -8
        peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        d = peak / -8
        q = torch.trunc(x * _inverse(d) + 8.5).clamp(max=15) - 8  # (int8_t)(x0 + 8.5f), MIN(15, .)
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(max=15)
        offset = _fp16(lo).reshape(n, k // GROUP)
    return BlockCodes(fmt, q.to(torch.int8).reshape(n, k), _fp16(d).reshape(n, k // GROUP), offset)


def concat(parts: Sequence[BlockCodes]) -> BlockCodes:
    """The weights stacked along N (fused q/k/v, gate/up); one format and K required."""
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1:
        raise ValueError(f"concat of mixed formats {sorted(fmts)}")
    offsets = [p.offset for p in parts]
    return BlockCodes(
        parts[0].fmt,
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        None if offsets[0] is None else torch.cat([o for o in offsets if o is not None]),
    )


def take_rows(codes: BlockCodes, index: torch.Tensor) -> BlockCodes:
    """Output rows `index` of the weight (a permutation or selection, e.g. q/k rotary layouts)."""
    off = codes.offset
    return BlockCodes(codes.fmt, codes.q[index], codes.scale[index], None if off is None else off[index])


ACTIVATIONS = ("int8",)  # QuantLinear's `activations` besides None (docs/int8-activations.md)


def takes(kernel: str, codes: BlockCodes) -> bool:
    """Whether `kernel` (a cell of the dispatch table's `linear_quant` or `linear_int8` rows) can run
    `codes` here; the int8 GEMM's VNNI variants only where the CPU has AVX-512 VNNI."""
    if kernel.startswith(("orcaserve.linear_quant.", "orcaserve.linear_int8.")):
        vnni = not kernel.endswith((".avx512_bf16", ".amx")) or kernel.startswith("orcaserve.linear_quant.")
        return codes.q.device.type == "cpu" and dispatch.available(kernel) and (vnni or dispatch.vnni())
    return kernel == "torch"


class QuantLinear:
    """y = x W^T + b with W kept in its block format: a drop-in for `kernels/linear.py`'s Linear.

    `kernel` (the dispatch table's `linear_quant` choice for the format by default, or a cell to
    force) is one of:
    - `orcaserve.linear_quant.<variant>`: the C++ GEMM over the codes packed once in panels
      (`kernels/cpu/csrc/gemm/gemm_quant.cpp`). For fp32 x bit for bit the project's fp32 GEMM
      (`Linear(dequantize(codes), bias, pack=True)`, same variant) on this CPU; for bf16 x that
      result on x.float(), rounded once to bf16.
    - `torch`: the PyTorch twin, where the C++ ops are not built: it keeps an fp32 copy of
      `dequantize(codes)` (4 bytes a weight: a fallback for correctness, not for memory) and runs
      F.linear in fp32. Its sums run in MKL's/oneDNN's order, not the C++ GEMM's: it matches the
      fp32 reference to fp32 rounding (rtol 1e-5, atol 1e-5 * sqrt(K) * max|x| * max|w|), not bitwise.

    With `activations="int8"` the `linear_int8` row chooses instead: x quantized per block of 32 to
    int8, integer dot products against the codes (`gemm/gemm_int8.cpp`), or its PyTorch twin
    (`kernels/pytorch/int8_activations.py`, over the codes as they are), bit for bit equal.
    """

    def __init__(
        self, codes: BlockCodes, bias: torch.Tensor | None, kernel: str | None = None, activations: str | None = None
    ) -> None:
        if activations not in (None, *ACTIVATIONS):
            raise ValueError(f"activations must be None or one of {ACTIVATIONS}, got {activations!r}")
        self.fmt = codes.fmt
        self.out_features, self.in_features = codes.shape
        self.bias = bias
        self.activations = activations
        op = "linear_int8" if activations == "int8" else "linear_quant"
        if kernel is not None and kernel.split(".")[1:2] in ([], [op]) and takes(kernel, codes):
            self.kernel = kernel
        else:
            self.kernel = dispatch.resolve(op, codes.fmt, lambda k: takes(k, codes))
        self._op: Any = None
        self._argmax_op: Any = None  # linear_int8_argmax: the rows' argmax without the output (argmax)
        self._bias32 = None if bias is None else bias.float()
        self._codes: BlockCodes | None = None
        if self.kernel.startswith("orcaserve.linear_int8."):
            pack = dispatch.orcaserve_op(self.kernel.replace(".linear_int8", ".pack_int8_weight", 1))
            self.weight = pack(codes.q, codes.scale, codes.offset, BITS[codes.fmt], codes.fmt in WIDE)
            self._op = dispatch.orcaserve_op(self.kernel)
            self._argmax_op = dispatch.orcaserve_op(self.kernel.replace(".linear_int8", ".linear_int8_argmax", 1))
        elif activations == "int8":  # the twin, over the codes as they are
            self._codes = codes
            self.weight = codes.q
        elif self.kernel.startswith("orcaserve."):
            pack_name = self.kernel.replace(".linear_quant", ".pack_quant_weight", 1)
            pack = dispatch.orcaserve_op(pack_name)
            self.weight = pack(codes.q, codes.scale, codes.offset, BITS[codes.fmt], codes.fmt in WIDE)
            self._op = dispatch.orcaserve_op(self.kernel)
        else:
            self.weight = dequantize(codes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] fp32 or bf16 -> [T, N] in x's dtype
        if self._op is not None:
            bits, wide = BITS[self.fmt], self.fmt in WIDE
            return self._op(x, self.weight, self._bias32, self.out_features, bits, self.fmt in OFFSET, wide)
        if self._codes is not None:
            c = self._codes
            return int8_activations.linear_int8(x, c.q, c.scale, c.offset, self._bias32)
        return F.linear(x.float(), self.weight, self._bias32).to(x.dtype)

    @property
    def has_argmax(self) -> bool:
        """Whether `argmax` runs (the kernel has the fused op)."""
        return self._argmax_op is not None

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:  # [T, K] -> [T] int64
        """`self(x).argmax(-1)` (first maximum, first NaN) taken as the GEMM computes the output,
        which is never written (a greedy lm_head: docs/one-stream.md, "The argmax inside the lm_head");
        None where the kernel has no such op."""
        if self._argmax_op is None:
            return None
        bits, wide = BITS[self.fmt], self.fmt in WIDE
        return self._argmax_op(x, self.weight, self._bias32, self.out_features, bits, self.fmt in OFFSET, wide)

    def nbytes(self) -> int:
        """Bytes the weight holds in the kernel's layout (codes, scales and mins; the twin's fp32 copy)."""
        heads = () if self._codes is None else (self._codes.scale, self._codes.offset)
        extra = sum(t.numel() * 4 for t in heads if t is not None)
        return int(self.weight.numel() * self.weight.element_size()) + extra


class QuantLinearGroup(QuantLinear):
    """QuantLinears over consecutive slices of the output, their results concatenated: a fused group
    (q/k/v, gate/up) whose members a file quantized in different formats (Q4_K_M keeps attn_v in
    Q6_K beside Q4_K q and k in some layers). Each output column is its own sum in the GEMM, so the
    split changes no bit of the result a fused weight would give."""

    def __init__(
        self,
        parts: Sequence[tuple[BlockCodes, torch.Tensor | None]],
        kernel: str | None = None,
        activations: str | None = None,
    ) -> None:
        self.parts = [QuantLinear(codes, bias, kernel, activations) for codes, bias in parts]
        self.fmt = "+".join(p.fmt for p in self.parts)
        self.out_features = sum(p.out_features for p in self.parts)
        self.in_features = self.parts[0].in_features
        self.kernel = self.parts[0].kernel
        self.bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def has_argmax(self) -> bool:
        return False

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

"""The lean decoder's linear layers: each weight packed once for the GEMM that runs it fastest on
this CPU (MKL, oneDNN, or the project's own C++ GEMMs), chosen per CPU kind as measured in
docs/engine.md, and the fused q/k/v and gate/up projections built from a model's own layers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels.cpu.build import has_op
from orcaserve.scheduler.config import cpu_has_native_bf16


def _can_pack(weight: torch.Tensor) -> bool:
    # oneDNN packs bf16 only where the CPU has AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an AVX2-only
    # CPU (AMD Zen 3) the reorder raises: bf16 runs the project's GEMM there (F.linear without it).
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    )


def _can_mkl(weight: torch.Tensor) -> bool:  # MKL's packed copy lives in a oneDNN tensor
    return (
        _can_pack(weight)
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


@functools.cache
def mkl_preferred() -> bool:
    """Whether fp32 GEMMs go to MKL rather than oneDNN: on Intel CPUs only. MKL's sgemm takes slower
    code paths on other vendors' CPUs: on an AMD Zen 3 (AVX2) oneDNN's pre-packed inner product ran
    SmolLM2's gate_up at 32 rows in 1.34 ms against MKL's 2.39, and every shape at 8-256 rows
    faster (`python benchmarks/gemm.py --dtype float32`; docs/peers.md, "On an AMD EPYC Zen 3")."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return True  # not Linux: as measured on Intel


def _runs_mkl(weight: torch.Tensor, mkl: bool | None = None) -> bool:
    """Whether a packed `weight` runs MKL's GEMM: where it can, and by default where preferred."""
    return _can_mkl(weight) and (mkl_preferred() if mkl is None else mkl)


def orca_gemm_preferred() -> bool:
    """Whether fp32 GEMMs go to the project's own (`kernels/cpu_gemm.cpp`): on every CPU kind
    measured. SmolLM2's fp32 layer GEMMs over 30 layers' weights (`python benchmarks/gemm.py
    --dtype float32 --layers 30`): on an AMD Zen 3 (AVX2) 1.14-1.39x as fast as oneDNN's
    pre-packed inner product at 1-512 rows (docs/engine.md, "Eighth round"); on a Zen 4 (AVX-512,
    whose 512-bit FMAs run as two 256-bit halves), in zmm registers, 0.69-0.80x oneDNN's time at
    32-64 rows and 0.92-0.99x at 128-512 ("Fourteenth round"); on an Intel Ice Lake (AVX-512, no
    AMX) 1.25-1.44x as fast as MKL's packed sgemm at 32-128 rows, 1.06-1.10x at 256-512,
    0.93-1.03x at 1-8 ("Nineteenth round"); on an Intel Sapphire Rapids (AMX) 1.08-1.47x as fast
    as MKL's at 1-512 rows ("Twentieth round")."""
    return True


@functools.cache
def orca_bf16_preferred() -> bool:
    """Whether bf16 GEMMs (those the `vdpbf16ps` GEMM does not take) go to the project's fp32 GEMM,
    which widens each bf16 panel as it goes: where the CPU has no native bf16. oneDNN cannot pack
    bf16 there on AVX2 CPUs (AMD Zen 3; "Ninth round") and emulates it on AVX-512 ones: on an Intel
    Ice Lake its packed inner product took 3.5-4.1x the widened GEMM's time at 32-512 rows (`python
    benchmarks/gemm.py --dtype bfloat16 --layers 30`; "Nineteenth round")."""
    return not cpu_has_native_bf16()


@functools.cache
def bf16_gemm_preferred() -> bool:
    """Whether bf16 GEMMs go to the project's `vdpbf16ps` GEMM (`kernels/cpu_gemm_bf16.cpp`): where
    the CPU has AVX-512 BF16 but no AMX, as on an AMD Zen 4. With AMX, oneDNN's tiles keep them."""
    return torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()


def _runs_dot(weight: torch.Tensor, dot: bool | None = None) -> bool:
    """Whether a packed bf16 `weight` runs `orcaserve::linear_packed_bf16`: where the op is built
    (AVX-512 BF16), the input width even (the weight is packed in pairs along it), and by default
    where preferred."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and (bf16_gemm_preferred() if dot is None else dot)
        and has_op("linear_packed_bf16")
    )


def _runs_orca(weight: torch.Tensor, orca: bool | None = None) -> bool:
    """Whether a packed fp32 or bf16 `weight` runs `orcaserve::linear_packed`: where the op is
    built, and by default where preferred (bf16 where the CPU has no native bf16 or oneDNN cannot
    pack it: it widens bf16 to fp32, half oneDNN's speed where the CPU computes bf16)."""
    if weight.dtype == torch.float32:
        preferred = orca_gemm_preferred()
    else:
        preferred = orca_bf16_preferred() or not _can_pack(weight)
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and (preferred if orca is None else orca)
        and has_op("linear_packed")  # last: it loads the library, needless where not preferred
    )


# bf16 GEMMs whose output is no wider than their input (o_proj, down_proj) run from the plain
# weight from this many rows on: there oneDNN's inner product on the packed weight is bimodal and
# slow in most runs (AMX; down_proj at 512 rows 2.0-2.6 ms against 1.4 for its matmul, F.linear),
# while below it the packed one wins (`python benchmarks/gemm.py`, docs/engine.md "Fourth
# round"). Keeping both copies costs those weights' memory twice.
PLAIN_FROM_ROWS = 384

# The row count MKL is told it packs for. Its packed layout of the weight does not depend on it
# (same size, and results bit for bit F.linear's at every count: tests/test_decoder_linear.py),
# so one packed copy serves every step.
MKL_PACK_ROWS = 32


class Linear:
    """y = x W^T + b from a weight packed once for the CPU's GEMM library: decode-sized GEMMs (tens
    of rows) otherwise pay a re-layout of the whole weight on every call.

    fp32 runs the project's own GEMM over its packed panels (`orca_gemm_preferred`; `orca`
    overrides), and so does bf16 where the CPU has no native bf16 (`orca_bf16_preferred`). Where
    that op is not built, fp32 runs MKL's packed GEMM on Intel CPUs (`torch.ops.mkl._mkl_linear`;
    `mkl` overrides): the sgemm behind F.linear (at most row counts bit for bit its results), on
    a Sapphire Rapids 10-25 % faster than oneDNN's pre-packed inner product at decode sizes and
    no slower above (`python benchmarks/gemm.py --dtype float32`), and without oneDNN's compile
    per new row count. With AVX-512 BF16 and no AMX bf16 runs the project's `vdpbf16ps` GEMM
    (`bf16_gemm_preferred`; `dot` overrides); elsewhere (AMX) oneDNN's inner product on its blocked
    layout (1.4-2x faster than unpacked). `plain_from`: from this many rows on, `F.linear` over
    the unpacked weight (kept for it; oneDNN only)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        plain_from: int | None = None,
        mkl: bool | None = None,
        orca: bool | None = None,
        dot: bool | None = None,
    ) -> None:
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1]
        self.bias = bias
        self.dot = pack and _runs_dot(weight, dot)
        self.orca = pack and not self.dot and _runs_orca(weight, orca)
        self.mkl = pack and not (self.dot or self.orca) and _runs_mkl(weight, mkl)
        self.packed = pack and (self.dot or self.orca or self.mkl or _can_pack(weight))
        # oneDNN's inner product, which compiles a kernel per new row count (MKL's and the
        # project's GEMMs do not).
        self.onednn = self.packed and not (self.dot or self.orca or self.mkl)
        if self.dot:  # [ceil(out / 48), in / 2, 48, 2] panels
            self.weight = torch.ops.orcaserve.pack_linear_weight_bf16(weight)
        elif self.orca:  # [ceil(out / w), in, w] panels, w = 48 where built for AVX-512, else 24
            self.weight = torch.ops.orcaserve.pack_linear_weight(weight)
        elif self.mkl:
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            # The op reads the plain weight's shape and dtype only, given the true row count as its
            # pack size: a stride-0 stand-in instead of a second copy of the weight.
            self.shape_of = weight.new_zeros(1, 1).expand(self.out_features, self.in_features)
        elif self.packed:  # oneDNN's blocked copy
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight
        keep_plain = self.onednn and plain_from is not None
        self.plain: torch.Tensor | None = weight.detach() if keep_plain else None
        self.plain_from = plain_from if keep_plain and plain_from is not None else 1 << 62

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.dot:
            return torch.ops.orcaserve.linear_packed_bf16(x, self.weight, self.bias, self.out_features)
        if self.orca:
            return torch.ops.orcaserve.linear_packed(x, self.weight, self.bias, self.out_features)
        if self.mkl:
            return torch.ops.mkl._mkl_linear(x, self.weight, self.shape_of, self.bias, x.shape[0])
        if self.plain is not None and x.shape[0] >= self.plain_from:
            return F.linear(x, self.plain, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fuse_linears(*linears: Any, pack: bool, plain_from: int | None = None) -> Linear:
    """One Linear over the concatenated outputs of `linears`, whose own weights are then freed:
    the engine owns the model, and keeping both would double its memory."""
    weight = torch.cat([lin.weight for lin in linears]) if len(linears) > 1 else linears[0].weight
    biases = [lin.bias for lin in linears]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat([b if b is not None else weight.new_zeros(lin.out_features) for lin, b in zip(linears, biases)])
    )
    fused = Linear(weight, bias, pack, plain_from)
    for lin in linears:
        lin.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        lin.bias = None  # an nn.Linear without a bias has None there
    return fused

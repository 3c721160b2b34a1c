"""The lean decoder's linear layers: each weight packed once for the GEMM that runs it on this CPU
(the project's C++ GEMMs, MKL, oneDNN, or F.linear), as `kernels/dispatch.py`'s table says for
the op `linear`, and the fused q/k/v and gate/up projections built from a model's own layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels import dispatch


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


def takes(kernel: str, weight: torch.Tensor) -> bool:
    """Whether `kernel` (a cell of the dispatch table's `linear` rows) can run `weight` here."""
    if weight.device.type != "cpu" and kernel != "torch":
        return False
    if kernel.startswith("orcaserve.linear_packed_bf16."):  # packed in pairs along the input width
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and dispatch.available(kernel)
    if kernel.startswith("orcaserve.linear_packed."):
        return weight.dtype in (torch.float32, torch.bfloat16) and dispatch.available(kernel)
    if kernel == "mkl":  # MKL's packed copy lives in a oneDNN tensor
        return weight.dtype == torch.float32 and _can_pack(weight) and dispatch.available(kernel)
    if kernel == "onednn":
        return _can_pack(weight)
    return kernel == "torch"


# bf16 GEMMs whose output is no wider than their input (o_proj, down_proj) run from the plain weight
# from this many rows on: there oneDNN's inner product on the packed weight is bimodal and slow in
# most runs (AMX), slower than the matmul on the plain copy (F.linear), while below it the packed
# one wins (`orcaserve-bench kernels gemm`;
# docs/performance-log.md#2026-11-30-gemms-at-prefill-sizes-and-on-first-use-plain-copies-for-bf16-o-and-down).
# Keeping both copies costs those weights' memory twice.
PLAIN_FROM_ROWS = 384

# The row count MKL is told it packs for. Its packed layout of the weight does not depend on it
# (same size, and results bit for bit F.linear's at every count: tests/model/test_decoder_linear.py),
# so one packed copy serves every step.
MKL_PACK_ROWS = 32


# Rows up to which a call is GEMV-shaped (a decode step of 1-4 streams; the C++ GEMMs' kStreamRows):
# its weight's read is nearly its whole cost. The dispatch table's `linear_gemv` row names the GEMM
# for them; where it is not the `linear` row's (AMX: oneDNN), the layer keeps a second copy of the
# weight packed for it, which costs the weight's memory twice.
GEMV_ROWS = 4


def _packed(kernel: str, weight: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(the op, the weight packed for it) of a project GEMM named `orcaserve.linear_packed*.<variant>`:
    [ceil(out / 48), in / 2, 48, 2] panels (bf16 pairs), or [ceil(out / w), in, w] with w = 48 on
    AVX-512 variants and 24 on avx2."""
    pack_name = kernel.replace(".linear_packed", ".pack_linear_weight", 1)
    return dispatch.orcaserve_op(kernel), dispatch.orcaserve_op(pack_name)(weight)


class Linear:
    """y = x W^T + b from a weight packed once for the CPU's GEMM: decode-sized GEMMs (tens of rows)
    otherwise pay a re-layout of the whole weight on every call.

    `kernel` (the dispatch table's choice by default; a table cell to force one, as the tests and
    A/B benchmarks do) is one of:
    - `orcaserve.linear_packed.<variant>`: the project's fp32 GEMM over its packed panels, bf16
      weights widened panel by panel (`kernels/cpu/csrc/gemm/gemm_fp32.cpp`);
    - `orcaserve.linear_packed_bf16.<variant>`: its `vdpbf16ps` GEMM (`gemm_bf16.cpp`);
    - `mkl`: MKL's packed sgemm (`torch.ops.mkl._mkl_linear`), the sgemm behind F.linear (at most
      row counts bit for bit its results), without oneDNN's compile per new row count;
    - `onednn`: oneDNN's inner product on its blocked layout (1.4-2x faster than unpacked);
      `plain_from`: from this many rows on, `F.linear` over the unpacked weight (kept for it);
    - `torch`: F.linear on the weight as it is.
    A kernel that cannot take the weight (see `takes`) gives way to the row's fallbacks. Calls of up
    to GEMV_ROWS rows run `gemv_kernel`: the table's `linear_gemv` choice where it is another
    project GEMM than `kernel` (with `gemv=False`, or a forced `kernel`, none: `kernel` runs them)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        plain_from: int | None = None,
        kernel: str | None = None,
        gemv: bool = True,
    ) -> None:
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1]
        self.bias = bias
        if not pack:
            self.kernel = "torch"
        elif kernel is not None and takes(kernel, weight):
            self.kernel = kernel
        else:
            self.kernel = dispatch.resolve("linear", weight.dtype, lambda k: takes(k, weight))
        self._op: Any = None
        self.gemv_kernel = self.kernel
        self._gemv_op: Any = None
        self.gemv_weight: torch.Tensor | None = None
        if pack and kernel is None and gemv and weight.dtype == torch.bfloat16:
            chosen = dispatch.resolve("linear_gemv", weight.dtype, lambda k: takes(k, weight))
            if chosen != self.kernel and chosen.startswith("orcaserve."):
                self.gemv_kernel = chosen
                self._gemv_op, self.gemv_weight = _packed(chosen, weight)
        if self.kernel.startswith("orcaserve."):
            self._op, self.weight = _packed(self.kernel, weight)
        elif self.kernel == "mkl":
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            # The op reads the plain weight's shape and dtype only, given the true row count as its
            # pack size: a stride-0 stand-in instead of a second copy of the weight.
            self.shape_of = weight.new_zeros(1, 1).expand(self.out_features, self.in_features)
        elif self.kernel == "onednn":  # oneDNN's blocked copy
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight
        # oneDNN's inner product compiles a kernel per new row count (MKL's and the project's GEMMs
        # do not): the decoder pads row counts where it runs.
        self.onednn = self.kernel == "onednn"
        keep_plain = self.onednn and plain_from is not None
        self.plain: torch.Tensor | None = weight.detach() if keep_plain else None
        self.plain_from = plain_from if keep_plain and plain_from is not None else 1 << 62

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._gemv_op is not None and x.shape[0] <= GEMV_ROWS:
            return self._gemv_op(x, self.gemv_weight, self.bias, self.out_features)
        if self._op is not None:
            return self._op(x, self.weight, self.bias, self.out_features)
        if self.kernel == "mkl":
            return torch.ops.mkl._mkl_linear(x, self.weight, self.shape_of, self.bias, x.shape[0])
        if self.plain is not None and x.shape[0] >= self.plain_from:
            return F.linear(x, self.plain, self.bias)
        if self.onednn:
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

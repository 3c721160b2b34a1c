"""The C++ LoRA operators (`kernels/cpu/csrc/gemm/lora.cpp`) behind the signatures of their PyTorch
twins (kernels/pytorch/lora.py), so that the dispatch table's cells of `lora_sgmv` and
`lora_batched` are interchangeable (docs/lora.md "The segmented update in the dispatch table")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, Part, lora_batched_parts, lora_sgmv

Sgmv = Callable[[torch.Tensor, torch.Tensor, Sequence[LoraGroup]], None]
Batched = Callable[[torch.Tensor, torch.Tensor, LoraBatch, torch.Tensor, torch.Tensor], None]
Parts = Callable[[torch.Tensor, torch.Tensor, LoraBatch, Sequence[Part]], None]


class SgmvCell:
    """`lora_sgmv` through the C++ op `op` (one call per group: its rows by index). The layer call
    runs the same `op` inside it (scheduler/model/layer_call.py)."""

    def __init__(self, op: Any) -> None:
        self.op = op  # torch.ops.orcaserve.lora_sgmv.<variant>

    def __call__(self, y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
        x = x.contiguous()  # once for every group, not a copy per group of a strided x
        for g in groups:
            self.op(y, x, row_indices(g.rows), g.a, g.b, g.scale)


def row_indices(rows: slice | torch.Tensor) -> torch.Tensor:
    """A group's rows as [N] int64 indices."""
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def sgmv_cell(op: Any) -> Sgmv:
    """`lora_sgmv` through the C++ op `op` (an `SgmvCell`)."""
    return SgmvCell(op)


def batched_cell(op: Any) -> Batched:
    """`lora_batched` through the C++ op `op`: every row against its own slot's R columns of the
    stacked weights, the slots present or not (no mask, no gather of the slots). It reads the
    batch's `row_slot` and `slot_scale` only: the twin's mask and row scales are never built."""
    parts = parts_cell(op)

    def run(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, a: torch.Tensor, b: torch.Tensor) -> None:
        parts(y, x, batch, [(0, y.shape[1], a, b)])

    return run


class PartsCell:
    """`lora_batched_parts` through the C++ op `op`: every projection of a fused output in one call
    (one parallel region for q/k/v, one for gate/up; docs/lora.md "Several adapters in one step").
    The layer call runs the same `op` inside it (scheduler/model/layer_call.py)."""

    def __init__(self, op: Any) -> None:
        self.op = op  # torch.ops.orcaserve.lora_batched.<variant>

    def __call__(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, parts: Sequence[Part]) -> None:
        a = [p[2] for p in parts]
        b = [p[3] for p in parts]
        cols = [c for p in parts for c in p[:2]]
        self.op(y, x.contiguous(), batch.row_slot, batch.slot_scale, a, b, cols, batch.rank)


def parts_cell(op: Any) -> Parts:
    """`lora_batched_parts` through the C++ op `op` (a `PartsCell`)."""
    return PartsCell(op)


# The blocked stacks (docs/lora.md "Several adapters in one step"): what the C++ operator reads in
# order on avx512_bf16 and amx in bf16 (gemm/lora_task.h's Adapter): per slot, A [R/4, in/32, 4, 32]
# (four rows of A side by side, 32 values at a time) and B^T [out/32, R, 32] (each block of 32
# outputs over the R ranks), R a multiple of 4, `in` and `out` zero-padded to 32s.
BLOCK = 32


def blocked(op: Any, dtype: torch.dtype) -> bool:
    """Whether the C++ `lora_batched` overload `op` reads the stacks blocked in `dtype`."""
    return op is not None and dtype == torch.bfloat16 and op._overloadname in ("avx512_bf16", "amx")


def blocked_rank(rank: int) -> int:
    return -(-rank // 4) * 4


def block_a(a: torch.Tensor, rank: int) -> torch.Tensor:
    """One adapter's A [r, in] as a slot of the blocked stacks at stacked rank `rank` (zeros past r)."""
    r, d_in = a.shape
    pad = F.pad(a, (0, -d_in % BLOCK, 0, rank - r))
    return pad.view(rank // 4, 4, -1, BLOCK).permute(0, 2, 1, 3)


def block_b(b: torch.Tensor, rank: int) -> torch.Tensor:
    """One adapter's B [out, r] (PEFT's) as a slot of the blocked stacks at stacked rank `rank`."""
    out, r = b.shape
    pad = F.pad(b.t(), (0, -out % BLOCK, 0, rank - r))
    return pad.view(rank, -1, BLOCK).permute(1, 0, 2)


def sgmv_for(dtype: torch.dtype, device: torch.device | str = "cpu", triton: Any = None) -> Sgmv:
    """The dispatch table's `lora_sgmv` for `dtype` on this machine; on a CUDA device the Triton
    kernels (kernels/triton/lora.py), as `linear_ternary`'s (kernels/ternary.py). `triton`: the
    engine's Triton cells over their buffers (kernels/triton/lora_cells.py), on any device (the CPU
    under the interpreter)."""
    if triton is not None:
        return triton.sgmv
    if torch.device(device).type == "cuda":
        from orcaserve.kernels.triton import lora as triton_lora

        return triton_lora.lora_sgmv
    op = dispatch.kernel("lora_sgmv", dtype)
    return lora_sgmv if op is None else sgmv_cell(op)


def batched_for(dtype: torch.dtype, device: torch.device | str = "cpu", triton: Any = None) -> tuple[Parts, bool]:
    """The dispatch table's `lora_batched` for `dtype` on this machine, taking a fused output's
    projections together, and whether it reads the stacks blocked; on a CUDA device (or given the
    engine's Triton cells, `triton`) the Triton kernels, on the standard stacks."""
    if triton is not None:
        return triton.parts, False
    if torch.device(device).type == "cuda":
        from orcaserve.kernels.triton import lora as triton_lora

        return triton_lora.lora_batched_parts, False
    op = dispatch.kernel("lora_batched", dtype)
    return (lora_batched_parts, False) if op is None else (parts_cell(op), blocked(op, dtype))

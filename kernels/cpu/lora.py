"""The C++ LoRA operators (`kernels/cpu/csrc/gemm/lora.cpp`) behind the signatures of their PyTorch
twins (kernels/pytorch/lora.py), so that the dispatch table's cells of `lora_sgmv` and
`lora_batched` are interchangeable (docs/lora.md "The segmented update in the dispatch table")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, lora_batched, lora_sgmv

Sgmv = Callable[[torch.Tensor, torch.Tensor, Sequence[LoraGroup]], None]
Batched = Callable[[torch.Tensor, torch.Tensor, LoraBatch, torch.Tensor, torch.Tensor], None]


def sgmv_cell(op: Any) -> Sgmv:
    """`lora_sgmv` through the C++ op `op` (one call per group: its rows by index)."""

    def run(y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
        x = x.contiguous()  # once for every group, not a copy per group of a strided x
        for g in groups:
            rows = torch.arange(g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else g.rows
            op(y, x, rows, g.a, g.b, g.scale)

    return run


def batched_cell(op: Any) -> Batched:
    """`lora_batched` through the C++ op `op`: every row against its own slot's R columns of the
    stacked weights, the slots present or not (no mask, no gather of the slots). It reads the
    batch's `row_slot` and `slot_scale` only: the twin's mask and row scales are never built."""

    def run(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, a: torch.Tensor, b: torch.Tensor) -> None:
        op(y, x.contiguous(), batch.row_slot, batch.slot_scale, a, b, batch.rank)

    return run


def sgmv_for(dtype: torch.dtype) -> Sgmv:
    """The dispatch table's `lora_sgmv` for `dtype` on this machine."""
    op = dispatch.kernel("lora_sgmv", dtype)
    return lora_sgmv if op is None else sgmv_cell(op)


def batched_for(dtype: torch.dtype) -> Batched:
    """The dispatch table's `lora_batched` for `dtype` on this machine."""
    op = dispatch.kernel("lora_batched", dtype)
    return lora_batched if op is None else batched_cell(op)

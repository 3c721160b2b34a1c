"""The segmented LoRA update in PyTorch: the oracle and the fallback of the dispatch table's
`lora_sgmv` op (kernels/dispatch.py; docs/lora.md "The segmented update").

A step's rows are packed over many requests; each request names at most one adapter. The rows of
one adapter form a group (a contiguous run, or the rows gathered by index), and each group adds
its adapter's low-rank update to the projection's output, in place:

    y[rows] += (x[rows] @ A^T) @ B^T * scale

computed as PEFT computes it (`lora_B(lora_A(x)) * scaling`, two bias-free linears then the
scale), so an adapter's answer here is PEFT's. Rows of no group (the base model's requests, pad
rows) are not touched: they pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraGroup:
    """The rows of a step that use one adapter, and that adapter's weights for one projection."""

    rows: slice | torch.Tensor  # a contiguous run, or [N] int64 row indices
    a: torch.Tensor  # [r, in]: PEFT's lora_A.weight
    b: torch.Tensor  # [out, r]: PEFT's lora_B.weight
    scale: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
    """Add each group's update to `y` [T, out] (a view: a column slice of a fused projection's
    output is fine) from `x` [T, in], in place. One GEMM pair per group."""
    for g in groups:
        if isinstance(g.rows, slice):
            delta = F.linear(F.linear(x[g.rows], g.a), g.b) * g.scale  # [N, out]
            y[g.rows] += delta
        else:
            delta = F.linear(F.linear(x.index_select(0, g.rows), g.a), g.b) * g.scale  # [N, out]
            y.index_add_(0, g.rows, delta)


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows of several adapters, laid out for two dense GEMMs per projection: `slots` [S']
    the resident adapters present in the step (sorted), `mask` [T, S' * R] one where a row's own
    adapter's R shrink columns are (zero elsewhere, and on rows of no adapter), `scale` [T, 1] fp32
    each row's adapter scale (0 on rows of no adapter), `every` whether `slots` is every resident
    adapter in slot order (then the stacked weights are used as they are); for the C++ operator
    (kernels/cpu/lora.py), `row_slot` [T] each row's slot (-1: none) and `slot_scale` [S] each
    slot's scale."""

    slots: torch.Tensor  # [S'] int64
    mask: torch.Tensor  # [T, S' * R] in the model's dtype
    scale: torch.Tensor  # [T, 1] fp32
    every: bool
    row_slot: torch.Tensor  # [T] int64
    slot_scale: torch.Tensor  # [S] fp32

    @classmethod
    def of(cls, row_slot: list[int], num_slots: int, rank: int, scales: list[float], dtype: torch.dtype) -> LoraBatch:
        """From each row's slot (-1: no adapter), `num_slots` resident adapters of stacked rank `rank`."""
        present = sorted({s for s in row_slot if s >= 0})
        at = {s: i for i, s in enumerate(present)}
        rows = torch.tensor([t for t, s in enumerate(row_slot) if s >= 0], dtype=torch.int64)
        pos = torch.tensor([at[s] for s in row_slot if s >= 0], dtype=torch.int64)
        mask = torch.zeros(len(row_slot), len(present), rank, dtype=dtype)
        mask[rows, pos] = 1
        scale = torch.zeros(len(row_slot), 1)
        scale[rows, 0] = torch.tensor([scales[s] for s in row_slot if s >= 0])
        every = present == list(range(num_slots))
        slots = torch.tensor(present, dtype=torch.int64)
        row_slots = torch.tensor(row_slot, dtype=torch.int64)
        slot_scale = torch.tensor(scales, dtype=torch.float32)
        return cls(slots, mask.view(len(row_slot), -1), scale, every, row_slots, slot_scale)


def lora_batched(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, a: torch.Tensor, b: torch.Tensor) -> None:
    """Every adapter of `batch` at once, for one projection: `a` [S * R, in] and `b` [out, S * R]
    every resident adapter's weights stacked slot by slot, each zero-padded to rank R (zeros where
    an adapter does not target the projection). Adds to `y` [T, out] (a view is fine) in place:

        h = (x @ a^T) * mask         # [T, S' R]: each row keeps its own adapter's shrink
        y += (h @ b^T) * scale        # [T, out]: the sum runs over the row's own R columns only

    With PEFT's roundings (the shrink, the expand and the scale each rounded to y's dtype, as in
    `lora_sgmv`); the other adapters' columns and the padding add exact zeros, and rows of no
    adapter get + 0 (pad rows past T are not touched)."""
    if not batch.every:  # only the adapters present: their slots' rows of a, columns of b
        rank = batch.mask.shape[1] // batch.slots.numel()
        a = a.view(-1, rank, a.shape[1]).index_select(0, batch.slots).view(-1, a.shape[1])
        b = b.view(b.shape[0], -1, rank).index_select(1, batch.slots).view(b.shape[0], -1)
    t = batch.mask.shape[0]  # the step's rows; pad rows after them are left alone
    x, y = x[:t], y[:t]
    h = F.linear(x, a) * batch.mask  # [T, S' R]
    d = F.linear(h, b)  # [T, out]
    y.add_((d.float() * batch.scale).to(y.dtype) if y.dtype != torch.float32 else d * batch.scale)

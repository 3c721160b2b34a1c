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
from functools import cached_property

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
    """A step's rows of several adapters: `slot_of` each row's slot (-1: no adapter) among
    `num_slots` resident adapters stacked at rank `rank`, `scales` each slot's scale. What each
    kernel reads is built from them on first use (the step builds one batch; the C++ operator
    reads only `row_slot` and `slot_scale`, so the twin's mask and row scales are not built where
    it runs: docs/lora.md "Several adapters in one step"):
    - for the C++ operator (kernels/cpu/lora.py): `row_slot` [T] int64, `slot_scale` [S] fp32;
    - for the twin's two dense GEMMs: `slots` [S'] the slots present in the step (sorted), `mask`
      [T, S' * R] one where a row's own adapter's R shrink columns are (zero elsewhere, and on rows
      of no adapter), `scale` [T, 1] fp32 each row's adapter scale (0 on rows of no adapter),
      `every` whether `slots` is every resident adapter in slot order (then the stacked weights are
      used as they are)."""

    slot_of: tuple[int, ...]
    num_slots: int
    rank: int
    scales: tuple[float, ...]
    dtype: torch.dtype
    device: str = "cpu"  # where the twin's tensors are built (the weights' device)

    @classmethod
    def of(
        cls,
        row_slot: list[int],
        num_slots: int,
        rank: int,
        scales: list[float],
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> LoraBatch:
        """From each row's slot (-1: no adapter), `num_slots` resident adapters of stacked rank `rank`."""
        return cls(tuple(row_slot), num_slots, rank, tuple(scales), dtype, device)

    @property
    def rows(self) -> int:
        """The step's rows (pad rows after them are not in the batch)."""
        return len(self.slot_of)

    @cached_property
    def row_slot(self) -> torch.Tensor:
        return torch.tensor(self.slot_of, dtype=torch.int64)

    @cached_property
    def slot_scale(self) -> torch.Tensor:
        return torch.tensor(self.scales, dtype=torch.float32)

    @cached_property
    def present(self) -> list[int]:
        return sorted({s for s in self.slot_of if s >= 0})

    @cached_property
    def slots(self) -> torch.Tensor:
        return torch.tensor(self.present, dtype=torch.int64, device=self.device)

    @cached_property
    def every(self) -> bool:
        return self.present == list(range(self.num_slots))

    @cached_property
    def mask(self) -> torch.Tensor:
        at = {s: i for i, s in enumerate(self.present)}
        rows = torch.tensor([t for t, s in enumerate(self.slot_of) if s >= 0], dtype=torch.int64)
        pos = torch.tensor([at[s] for s in self.slot_of if s >= 0], dtype=torch.int64)
        mask = torch.zeros(self.rows, len(self.present), self.rank, dtype=self.dtype)
        mask[rows, pos] = 1
        return mask.view(self.rows, -1).to(self.device)

    @cached_property
    def scale(self) -> torch.Tensor:
        scale = torch.zeros(self.rows, 1)
        scale[:, 0] = torch.tensor([self.scales[s] if s >= 0 else 0.0 for s in self.slot_of])
        return scale.to(self.device)


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
        rank = batch.rank
        a = a.view(-1, rank, a.shape[1]).index_select(0, batch.slots).view(-1, a.shape[1])
        b = b.view(b.shape[0], -1, rank).index_select(1, batch.slots).view(b.shape[0], -1)
    t = batch.rows  # the step's rows; pad rows after them are left alone
    x, y = x[:t], y[:t]
    h = F.linear(x, a) * batch.mask  # [T, S' R]
    d = F.linear(h, b)  # [T, out]
    y.add_((d.float() * batch.scale).to(y.dtype) if y.dtype != torch.float32 else d * batch.scale)


Part = tuple[int, int, torch.Tensor, torch.Tensor]  # first column, last column, a, b: one projection


def lora_batched_parts(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, parts: Sequence[Part]) -> None:
    """`lora_batched` for each projection of a fused output `y` (q/k/v, gate/up: one `x`), each
    `(first, last, a, b)` updating y's columns [first, last)."""
    for first, last, a, b in parts:
        lora_batched(y[:, first:last], x, batch, a, b)

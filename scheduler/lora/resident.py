"""The adapters an engine serves, held beside the base model, and each step's grouping of rows by
adapter (docs/lora.md "One step, many adapters").

`LoraSet` keeps every adapter loaded at start (up to `max_loras`), indexed the way the lean
decoder's fused projections lay out their outputs: q/k/v in one GEMM's columns, gate/up in
another's. `LoraSet.step` reads a scheduled batch and returns a `LoraStep`: per adapter the rows
its requests feed in this step (one contiguous run where they are adjacent, else gathered by
index), or None when no request of the step names an adapter, so a step of the base model alone
runs exactly as without adapters. `LoraStep.apply` adds the update of one fused projection: through
the dispatch table's `lora_sgmv` kernel, one GEMM pair per adapter, when the step holds one
adapter; through `lora_batched`, one batched GEMM pair for all of them, when it holds several
(docs/lora.md "Several adapters in one step").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, lora_batched, lora_sgmv
from orcaserve.scheduler.lora.adapter import LoraAdapter, ModuleShapes

# The lean decoder's fused projections and the modules whose outputs they concatenate, in order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KERNELS = {"torch": lora_sgmv}  # the dispatch table's `lora_sgmv` cells -> the op


class LoraSet:
    """The resident adapters (slot i is `adapters[i]`), each projection's weights per slot."""

    def __init__(self, adapters: Iterable[LoraAdapter], base: ModuleShapes, dtype: torch.dtype) -> None:
        self.adapters = list(adapters)
        self.dtype = dtype
        self.slots = {a.name: i for i, a in enumerate(self.adapters)}
        self.op: Any = _KERNELS[dispatch.resolve("lora_sgmv", dtype)]
        # (layer, fused) -> [(first column, last column, {slot: (A, B, scale)})] for each module
        # an adapter targets there.
        self.table: dict[tuple[int, str], list[tuple[int, int, dict[int, tuple[torch.Tensor, torch.Tensor, float]]]]]
        self.table = {}
        for layer in range(base.num_layers):
            for fused, modules in FUSED.items():
                col, entries = 0, []
                for module in modules:
                    width = base.shapes[module][1]
                    per_slot = {
                        slot: (*a.weights[layer, module], a.scale)
                        for slot, a in enumerate(self.adapters)
                        if (layer, module) in a.weights
                    }
                    if per_slot:
                        entries.append((col, col + width, per_slot))
                    col += width
                if entries:
                    self.table[layer, fused] = entries
        # (layer, fused) -> [(first column, last column, A [S * R, in], B [out, S * R])]: every
        # slot's weights stacked, zero-padded to the largest rank R of the resident adapters (zeros
        # for a slot that does not target the module), for several adapters in one step.
        self.rank = max(a.rank for a in self.adapters)
        n = len(self.adapters)
        self.stacked = {key: [_stack(entry, n, self.rank) for entry in entries] for key, entries in self.table.items()}

    @property
    def nbytes(self) -> int:
        """What the adapters hold resident: their own weights and the stacked copy."""
        stacked = sum(a.nbytes + b.nbytes for entries in self.stacked.values() for _, _, a, b in entries)
        return sum(a.nbytes for a in self.adapters) + stacked

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def step(self, num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]) -> LoraStep | None:
        """The step's rows grouped by adapter (batch order: `num_scheduled_tokens`, `requests`'
        `lora`), or None when no request of the step names one."""
        runs: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for rid, n in num_scheduled_tokens.items():
            name = requests[rid].lora
            if name is not None:
                spans = runs.setdefault(self.slots[name], [])
                if spans and spans[-1][1] == row:  # adjacent to the last run of the same adapter
                    spans[-1] = (spans[-1][0], row + n)
                else:
                    spans.append((row, row + n))
            row += n
        if not runs:
            return None
        batch = None
        if len(runs) > 1:
            row_slot = [-1] * row
            for slot, spans in runs.items():
                for s, e in spans:
                    row_slot[s:e] = [slot] * (e - s)
            batch = LoraBatch.of(row_slot, len(self.adapters), self.rank, [a.scale for a in self.adapters], self.dtype)
        return LoraStep(self, {slot: _rows(spans) for slot, spans in runs.items()}, batch)

    def uniform(self, name: str, num_rows: int) -> LoraStep:
        """Every one of `num_rows` rows under adapter `name` (a prompt's own forward: prompt_logprobs.py)."""
        return LoraStep(self, {self.slots[name]: slice(0, num_rows)})


def _stack(
    entry: tuple[int, int, dict[int, tuple[torch.Tensor, torch.Tensor, float]]], num_slots: int, rank: int
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    first, last, per_slot = entry
    some_a, some_b, _ = next(iter(per_slot.values()))
    a_all = some_a.new_zeros(num_slots, rank, some_a.shape[1])  # [S, R, in]
    b_all = some_b.new_zeros(some_b.shape[0], num_slots, rank)  # [out, S, R]
    for slot, (a, b, _) in per_slot.items():
        a_all[slot, : a.shape[0]] = a
        b_all[:, slot, : b.shape[1]] = b
    return first, last, a_all.view(-1, some_a.shape[1]), b_all.view(some_b.shape[0], -1)


def _rows(spans: list[tuple[int, int]]) -> slice | torch.Tensor:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(s, e) for s, e in spans])  # [N] int64


class LoraStep:
    """One step's adapters: slot -> the rows it updates."""

    def __init__(self, loras: LoraSet, rows: dict[int, slice | torch.Tensor], batch: LoraBatch | None = None) -> None:
        self.loras = loras
        self.rows = rows
        self.batch = batch  # several adapters: their rows laid out for the batched update

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to `y` [T, out] (fused projection `fused` of `layer`, from `x` [T, in]) the update
        of every adapter with rows in the step, in place."""
        if self.batch is not None:
            for first, last, a, b in self.loras.stacked.get((layer, fused), ()):
                lora_batched(y[:, first:last], x, self.batch, a, b)
            return
        for first, last, per_slot in self.loras.table.get((layer, fused), ()):
            groups = [LoraGroup(rows, *per_slot[slot]) for slot, rows in self.rows.items() if slot in per_slot]
            if groups:
                self.loras.op(y[:, first:last], x, groups)

"""The adapters an engine serves, held beside the base model, and each step's grouping of rows by
adapter (docs/lora.md "One step, many adapters").

`LoraSet` keeps every host-resident adapter (up to `max_cpu_loras`: those loaded at start and at
run time), indexed the way the lean decoder's fused projections lay out their outputs: q/k/v in
one GEMM's columns, gate/up in another's. Of them, the `max_loras` the scheduler stacked
(`LoraSlots`, slots.py) are also copied slot by slot into stacked weights, for the batched update
of several adapters in one step. `LoraSet.step` first brings the stacked copy in line with the
slots (a copy from the host copy of each adapter that changed slot: nothing is read from disk),
then reads a scheduled batch and returns a `LoraStep`: per adapter the rows its requests feed in
this step (one contiguous run where they are adjacent, else gathered by index), or None when no
request of the step names an adapter, so a step of the base model alone runs exactly as without
adapters. `LoraStep.apply` adds the update of one fused projection: through the dispatch table's
`lora_sgmv`, one GEMM pair per adapter, when the step holds one adapter; through `lora_batched`,
one batched GEMM pair for all of them, when it holds several (docs/lora.md "Several adapters in
one step").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from orcaserve.kernels.cpu.lora import BLOCK, batched_for, block_a, block_b, blocked_rank, sgmv_for
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup
from orcaserve.scheduler.lora.adapter import LoraAdapter, ModuleShapes
from orcaserve.scheduler.lora.slots import LoraSlots

# The lean decoder's fused projections and the modules whose outputs they concatenate, in order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
Entry = tuple[int, int, torch.Tensor, torch.Tensor, float]  # first column, last column, A, B, scale
Key = tuple[int, str]  # (layer, module)
Flat = tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]  # LoraSet.flat()


class LoraSet:
    """The host-resident adapters by name, and the stacked copy of those in the `max_loras` slots."""

    def __init__(
        self,
        adapters: Iterable[LoraAdapter],
        base: ModuleShapes,
        dtype: torch.dtype,
        max_loras: int,
        device: torch.device | str = "cpu",
        triton: Any = None,
    ) -> None:
        self.base = base  # what a later adapter must fit (runtime loads: runtime.py)
        self.dtype = dtype
        # Where the adapters and their stacks live: the model's device (docs/lora.md "The Triton
        # kernels in the engine"). `triton`: the engine's Triton cells (kernels/triton/lora_cells.py).
        self.device = torch.device(device)
        self.adapters: dict[str, LoraAdapter] = {}
        # adapter -> (layer, fused) -> the modules it targets there, at their columns of the output.
        self.tables: dict[str, dict[tuple[int, str], list[Entry]]] = {}
        self.slots = LoraSlots(max_loras, self.adapters)  # which adapters are stacked (the scheduler changes it)
        # The dispatch table's cells: `lora_sgmv` (one adapter's rows) and `lora_batched` (several).
        self.op: Any = sgmv_for(dtype, self.device, triton)
        self.batched_op: Any
        self.blocked: bool  # the stacks in the C++ operator's blocked layout (kernels/cpu/lora.py)
        self.batched_op, self.blocked = batched_for(dtype, self.device, triton)
        # On the Triton path the stacks are allocated once, at the first sync, for every projection at
        # `max_lora_rank` (0: elsewhere, sized to the stacked adapters; docs/lora.md "The Triton
        # kernels in the engine").
        self.fixed_rank: int = 0 if triton is None else triton.max_rank
        # The stacked copy: what each slot holds now, the stacked rank R, the (layer, module) pairs
        # stacked, per pair A [S, R, in] and B [out, S, R] (stored transposed: B^T [S, R, out]; zeros
        # for a free slot, an adapter that does not target the module, and past an adapter's own
        # rank), and per (layer, fused) their views [S R, in], [out, S R] at the module's columns.
        self._stacked_names: list[str | None] = [None] * len(self.slots.names)
        self.rank = 0
        self._keys: frozenset[Key] = frozenset()
        self._stacks: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stacked: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        self._flat: Flat | None = None  # `stacked` flat over the layers, for the layer call (flat())
        self.tokens: Counter[str] = Counter()  # tokens computed under each adapter (metrics)
        for adapter in adapters:
            self.add(adapter)
        self.sync()

    def add(self, adapter: LoraAdapter) -> None:
        """Hold `adapter` on the host (its name free); stacked at once while a slot is free, else when
        the scheduler admits a request of it."""
        table: dict[tuple[int, str], list[Entry]] = {}
        for layer in range(self.base.num_layers):
            for fused, first, last, module in self._columns():
                if (layer, module) in adapter.weights:
                    a, b = adapter.weights[layer, module]
                    table.setdefault((layer, fused), []).append((first, last, a, b, adapter.scale))
        self.adapters[adapter.name] = adapter
        self.tables[adapter.name] = table
        if None in self.slots.names:
            self.slots.admit(adapter.name, frozenset)

    def remove(self, name: str) -> None:
        """Drop `name` from the host and its slot (the caller knows no request uses it any more)."""
        self.slots.drop(name)
        del self.adapters[name], self.tables[name]

    def _columns(self) -> Iterable[tuple[str, int, int, str]]:
        for fused, modules in FUSED.items():
            col = 0
            for module in modules:
                width = self.base.shapes[module][1]
                yield fused, col, col + width, module
                col += width

    @property
    def nbytes(self) -> int:
        """What the adapters hold resident: their own weights and the stacked copy."""
        stacked = sum(a.nbytes + b.nbytes for a, b in self._stacks.values())
        return sum(a.nbytes for a in self.adapters.values()) + stacked

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    # ---- the stacked copy follows the slots -----------------------------------------------------
    def sync(self) -> None:
        """Bring the stacked copy in line with `slots`: each slot that changed adapter is rewritten
        in place from the adapter's host copy; the stacks are rebuilt when the new set of adapters
        needs a larger rank or another set of modules (never with `fixed_rank`: allocated once)."""
        want = list(self.slots.names)
        if want == self._stacked_names:
            return
        held = [self.adapters[n] for n in want if n is not None]
        keys = frozenset(key for a in held for key in a.weights)
        rank = max((a.rank for a in held), default=0)
        rank = blocked_rank(rank) if self.blocked else rank
        if self.fixed_rank:
            keys = frozenset((layer, m) for layer in range(self.base.num_layers) for *_, m in self._columns())
            rank = max(rank, self.fixed_rank)
        if rank > self.rank or keys != self._keys:
            self._rebuild(want, keys, rank)
        else:
            for slot, (old, new) in enumerate(zip(self._stacked_names, want)):
                if old != new:
                    self._fill(slot, new)
        self._stacked_names = want

    def use_batched(self, op: Any, blocked: bool) -> None:
        """Run the batched update through `op`, the stacks rebuilt in its layout (`blocked`: the C++
        operator's, kernels/cpu/lora.py)."""
        self.batched_op, self.blocked = op, blocked
        self._stacked_names, self.rank, self._keys = [None] * len(self.slots.names), 0, frozenset()
        self.sync()

    def _rebuild(self, want: list[str | None], keys: frozenset[Key], rank: int) -> None:
        n = len(want)
        self.rank, self._keys, self._stacks, self.stacked, self._flat = rank, keys, {}, {}, None
        for layer, module in sorted(keys):
            in_f, out_f = self.base.shapes[module]
            if self.blocked:  # [S, R/4, in/32, 4, 32] and [S, out/32, R, 32], read in order by the C++ operator
                a_blk = torch.zeros(n, rank // 4, -(-in_f // BLOCK), 4, BLOCK, dtype=self.dtype, device=self.device)
                b_blk = torch.zeros(n, -(-out_f // BLOCK), rank, BLOCK, dtype=self.dtype, device=self.device)
                self._stacks[layer, module] = (a_blk, b_blk)
                continue
            a_all = torch.zeros(n, rank, in_f, dtype=self.dtype, device=self.device)  # [S, R, in]
            # [out, S, R] over B^T's storage [S, R, out]: each of B's columns contiguous, as the C++
            # expand reads them (docs/lora.md "Several adapters in one step")
            b_all = torch.zeros(n, rank, out_f, dtype=self.dtype, device=self.device).permute(2, 0, 1)
            self._stacks[layer, module] = (a_all, b_all)
        for layer in range(self.base.num_layers):
            for fused, first, last, module in self._columns():
                if (layer, module) in self._stacks:
                    a_all, b_all = self._stacks[layer, module]
                    if self.blocked:
                        views = (first, last, a_all, b_all)
                    else:
                        views = (first, last, a_all.view(-1, a_all.shape[2]), b_all.view(b_all.shape[0], -1))
                    self.stacked.setdefault((layer, fused), []).append(views)
        for slot, name in enumerate(want):
            if name is not None:
                self._fill(slot, name)

    def flat(self) -> Flat:
        """`stacked` as the layer call takes it (scheduler/model/layer_call.py): every layer's fused
        projections in order (qkv, o, gate_up, down), their parts' A, B and first and last columns
        flat, and how many parts each (layer, fused) has. The same tensors LoraStep.apply passes;
        built once per rebuild of the stacks (a slot's fill is in place)."""
        if self._flat is None:
            self._flat = self._flatten(self.stacked)[0]
        return self._flat

    def flat_one(self, name: str) -> tuple[Flat, list[float]]:
        """As `flat`, for adapter `name`'s own weights (a step of one adapter, `lora_sgmv`), with each
        part's scale."""
        return self._flatten(self.tables[name])

    def _flatten(self, table: Mapping[tuple[int, str], Sequence[tuple[Any, ...]]]) -> tuple[Flat, list[float]]:
        a: list[torch.Tensor] = []
        b: list[torch.Tensor] = []
        cols: list[int] = []
        counts: list[int] = []
        scales: list[float] = []  # the parts' scales, where the table has them (an adapter's own)
        for layer in range(self.base.num_layers):
            for fused in FUSED:
                parts = table.get((layer, fused), [])
                counts.append(len(parts))
                for part in parts:
                    cols += part[:2]
                    a.append(part[2])
                    b.append(part[3])
                    scales += part[4:]
        return (a, b, cols, counts), scales

    def _fill(self, slot: int, name: str | None) -> None:
        """Slot `slot` holds `name`'s weights (None: zeros), zero-padded past its rank."""
        weights = {} if name is None else self.adapters[name].weights
        for key, (a_all, b_all) in self._stacks.items():
            pair = weights.get(key)
            if self.blocked:
                if pair is None:
                    a_all[slot].zero_()
                    b_all[slot].zero_()
                else:
                    a_all[slot] = block_a(pair[0], self.rank)
                    b_all[slot] = block_b(pair[1], self.rank)
                continue
            rank = 0 if pair is None else pair[0].shape[0]
            if pair is not None:
                a_all[slot, :rank] = pair[0]
                b_all[:, slot, :rank] = pair[1]
            if rank < a_all.shape[1]:  # what the copy did not overwrite
                a_all[slot, rank:].zero_()
                b_all[:, slot, rank:].zero_()

    # ---- a step's rows -------------------------------------------------------------------------
    def step(self, num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]) -> LoraStep | None:
        """The step's rows grouped by adapter (batch order: `num_scheduled_tokens`, `requests`'
        `lora`), or None when no request of the step names one. Every adapter named must hold a
        slot (the scheduler admits a request only then: slots.py); one that does not is a bug,
        refused rather than served under another slot's weights."""
        self.sync()
        runs: dict[str, list[tuple[int, int]]] = {}
        row = 0
        for rid, n in num_scheduled_tokens.items():
            name = requests[rid].lora
            if name is not None:
                self.tokens[name] += n
                spans = runs.setdefault(name, [])
                if spans and spans[-1][1] == row:  # adjacent to the last run of the same adapter
                    spans[-1] = (spans[-1][0], row + n)
                else:
                    spans.append((row, row + n))
            row += n
        if not runs:
            return None
        missing = [name for name in runs if name not in self.slots]
        if missing:
            raise RuntimeError(f"LoRA adapters {missing} are in the step but hold no slot")
        batch = None
        if len(runs) > 1:
            row_slot = [-1] * row
            for name, spans in runs.items():
                slot = self.slots.slot_of(name)
                for s, e in spans:
                    row_slot[s:e] = [slot] * (e - s)
            scales = [0.0 if n is None else self.adapters[n].scale for n in self._stacked_names]
            batch = LoraBatch.of(row_slot, len(scales), self.rank, scales, self.dtype, str(self.device))
        return LoraStep(self, {name: _rows(spans) for name, spans in runs.items()}, batch)

    def uniform(self, name: str, num_rows: int) -> LoraStep:
        """Every one of `num_rows` rows under adapter `name` (a prompt's own forward:
        prompt_logprobs.py): one adapter, its own weights, no slot needed. Refused while the
        adapter is on disk (past `max_cpu_loras`: runtime.py), never run without its update."""
        if name not in self.adapters:
            raise RuntimeError(f"LoRA adapter {name!r} is being read back from disk (max_cpu_loras): retry")
        return LoraStep(self, {name: slice(0, num_rows)})


def _rows(spans: list[tuple[int, int]]) -> slice | torch.Tensor:
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(s, e) for s, e in spans])  # [N] int64


class LoraStep:
    """One step's adapters: adapter name -> the rows it updates."""

    def __init__(self, loras: LoraSet, rows: dict[str, slice | torch.Tensor], batch: LoraBatch | None = None) -> None:
        self.loras = loras
        self.rows = rows
        self.batch = batch  # several adapters: their rows laid out for the batched update

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to `y` [T, out] (fused projection `fused` of `layer`, from `x` [T, in]) the update
        of every adapter with rows in the step, in place."""
        loras = self.loras
        if self.batch is not None:
            parts = loras.stacked.get((layer, fused))
            if parts:
                loras.batched_op(y, x, self.batch, parts)
            return
        for name, rows in self.rows.items():
            for first, last, a, b, scale in loras.tables[name].get((layer, fused), ()):
                loras.op(y[:, first:last], x, [LoraGroup(rows, a, b, scale)])

"""When speculating pays: per step from the step-cost model, per request from its acceptance
(docs/speculative-decoding.md "When it pays").

A proposed token costs what a prompt token costs in the step (the cost model's `prompt_tokens`
coefficient, plus the K/V it reads) and is worth the tokens it is expected to add: the row's
measured accepted tokens per speculated step. A row speculates when that gain per second beats
what the step already yields per second (its sampled rows over its predicted time), taking the
best rows first, so speculation stops as the batch fills and the step's rows already keep the
machine busy. Before the model has seen enough steps every eligible row speculates: those steps
are what it learns the price of a proposed token from.

A request's K follows its acceptance (one more than its recent accepted tokens, up to the
configured K); a request whose recent acceptance stays below `min_accepted` stops proposing for
a while (doubling each time), then tries again.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.step_cost import StepCostModel, StepShape, row_context
from orcaserve.scheduler.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from orcaserve.scheduler.core.step_output import SchedulerOutput

EMA = 0.3  # weight of the newest step in a request's accepted-tokens average
PROBATION = 4  # speculated steps before a request's average may pause it
PAUSE_STEPS = 16  # first pause, in steps; doubles each time, up to MAX_PAUSE
MAX_PAUSE = 512


@dataclass
class _Row:
    accepted: float  # recent accepted tokens per speculated step (exponential average)
    steps: int = 0
    paused: int = 0  # steps left without proposals
    pause_next: int = PAUSE_STEPS


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k_max = config.num_speculative_tokens
        self.min_accepted = config.min_accepted
        self.cost = StepCostModel()
        self._rows: dict[str, _Row] = {}
        self.declined_steps = 0  # steps the cost model found speculation would not pay

    def _row(self, rid: str) -> _Row:
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = _Row(accepted=min(1.0, float(self.k_max)))
        return row

    def k_for(self, rid: str) -> int:
        """The proposals a request gets this step (0: paused)."""
        row = self._row(rid)
        if row.paused > 0:
            row.paused -= 1
            if row.paused == 0:
                row.accepted, row.steps = max(row.accepted, self.min_accepted, 0.5), 0  # try again
            return 0
        return max(1, min(self.k_max, ceil(row.accepted) + 1))

    def plan(self, sched: SchedulerOutput, candidates: list[Request]) -> list[tuple[Request, int]]:
        """The rows that speculate this step, best first, with their K."""
        picks = [(req, k) for req in candidates if (k := self.k_for(req.request_id)) > 0]
        coef = self.cost.coefficients
        shape = sched.shape
        if not picks or coef is None or shape is None:
            return picks  # the cost model is still learning: every eligible row speculates
        base = self.cost.predict(shape) or 0.0
        rows = len(sched.sampling)
        if base <= 0.0:
            return picks
        c_prompt, c_decode, c_context = coef[1], coef[2], coef[3]
        scored = []
        for req, k in picks:
            computed = req.num_computed_tokens
            extra = (
                c_prompt * (1 + k) - c_decode + c_context * (row_context(computed, 1 + k) - row_context(computed, 1))
            )
            gain = min(self._row(req.request_id).accepted, float(k))
            scored.append((gain / extra if extra > 0 else float("inf"), gain, extra, req, k))
        scored.sort(key=lambda s: s[0], reverse=True)
        tokens, seconds = float(rows), base
        chosen = []
        for rate, gain, extra, req, k in scored:
            if rate <= tokens / seconds:
                break
            chosen.append((req, k))
            tokens, seconds = tokens + gain, seconds + max(extra, 0.0)
        if not chosen:
            self.declined_steps += 1
        return chosen

    def observe(self, rid: str, proposed: int, accepted: int) -> None:
        """A speculated row's outcome: its average, and a pause if it stays below the floor."""
        row = self._row(rid)
        row.accepted += EMA * (accepted - row.accepted)
        row.steps += 1
        if row.steps >= PROBATION and row.accepted < self.min_accepted:
            row.paused, row.pause_next = row.pause_next, min(MAX_PAUSE, row.pause_next * 2)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)

    def drop(self, rid: str) -> None:
        self._rows.pop(rid, None)

"""When speculating pays: per step from the step-cost model, per request from its acceptance
(docs/speculative-decoding.md "When it pays").

A proposed token is a row of the step: it computes its logits and samples as a decode row does, so
the step is priced by its total rows through the cost model (`decode_rows`, plus the K/V the row
reads). The j-th proposal of a request is worth alpha^j tokens, alpha the request's measured
chance that a proposal is accepted given those before it were (so K proposals are worth
alpha + ... + alpha^K). Every proposal is an item with a gain per second; the step takes them,
best first, while their gain per second beats what the step already yields per second (its sampled
tokens over its predicted time). So each request's K follows its acceptance and the step's price:
long runs of proposals at one stream, where a row is nearly free beside the weight reads, none as
the batch fills and the step's rows already keep the machine busy. Before the model has seen
enough steps every eligible row speculates with the configured K: those steps are what it learns
the price of a row from.

A request's acceptance is kept per kind of proposal (`kind`, 0 when the proposer does not tell
them apart): prompt lookup tells the length of the suffix its proposal matched (`match_kind`), as
a copied run found by 8 tokens is accepted far more often than a guess from one token. So a request
whose one-token guesses fail keeps speculating, with its full K, on the long matches of a copied
run. A kind whose recent accepted tokens per speculated step stay below `min_accepted` stops
proposing for a while (doubling each time), then tries again; the request's other kinds go on.
A request's first proposal of a kind starts from the engine's averages of that kind over all
requests where they are higher than the default (docs/speculative-decoding.md "When it pays", "A
request's start per kind"): a copied run gets the K long matches have earned from its first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.step_cost import FEATURES, StepCostModel, StepShape, row_context
from orcaserve.scheduler.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from orcaserve.scheduler.core.step_output import SchedulerOutput

EMA = 0.3  # weight of the newest step in a request's averages
PRIOR_EMA = 0.1  # weight of the newest step in the engine's averages per kind (a new request's start)
PROBATION = 4  # speculated steps before a request's average may pause it
PAUSE_STEPS = 16  # first pause, in steps; doubles each time, up to MAX_PAUSE
MAX_PAUSE = 512
MAX_ALPHA = 0.95  # a request that accepted everything so far is not taken as certain
Item = tuple[float, float, float, int, int]  # a proposal: gain per second, gain, seconds, its pick, j (1..K)
KINDS = 4  # match lengths 1, 2-3, 4-7, 8 and more
ROWS, CONTEXT = FEATURES.index("decode_rows"), FEATURES.index("context_kilo")  # the cost model's terms


def match_kind(length: int) -> int:
    """The kind of a prompt-lookup proposal from the length of the suffix it matched (>= 1)."""
    return min(KINDS - 1, max(length, 1).bit_length() - 1)


@dataclass
class _Row:
    accepted: float = 1.0  # recent accepted proposals per speculated step (exponential average)
    checked: float = 2.0  # recent proposals decided per speculated step: the accepted and the first rejected
    steps: int = 0
    paused: int = 0  # steps left without proposals
    pause_next: int = PAUSE_STEPS

    @property
    def alpha(self) -> float:
        """The chance a proposal is accepted, given that the ones before it were."""
        return min(MAX_ALPHA, self.accepted / self.checked) if self.checked > 0 else 0.0


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k_max = config.num_speculative_tokens
        self.min_accepted = config.min_accepted
        self.cost = StepCostModel()
        self._rows: dict[str, dict[int, _Row]] = {}  # per request, per kind of proposal
        self._prior: dict[int, tuple[float, float]] = {}  # per kind, over all requests: (accepted, checked)
        self.declined_steps = 0  # steps the cost model found speculation would not pay

    def _row(self, rid: str, kind: int = 0) -> _Row:
        rows = self._rows.get(rid)
        if rows is None:
            rows = self._rows[rid] = {}
        row = rows.get(kind)
        if row is None:
            row = rows[kind] = _Row()
            # The engine's averages of the kind where they beat the default's one half (never lower:
            # a new request keeps its probation).
            accepted, checked = self._prior.get(kind, (row.accepted, row.checked))
            if accepted * row.checked > row.accepted * checked:
                row.accepted, row.checked = accepted, checked
        return row

    def k_for(self, rid: str, kind: int = 0) -> int:
        """The most proposals a request may get this step for a proposal of `kind` (0: paused)."""
        row = self._row(rid, kind)
        if row.paused > 0:
            row.paused -= 1
            if row.paused == 0:  # try again, from an acceptance of one half
                row.accepted = max(row.accepted, self.min_accepted, 0.5)
                row.checked, row.steps = 2 * row.accepted, 0
            return 0
        return self.k_max

    def plan(
        self, sched: SchedulerOutput, candidates: list[Request], kinds: Mapping[str, int] | None = None
    ) -> list[tuple[Request, int]]:
        """The rows that speculate this step, best first, with their K; `kinds`: each candidate's
        kind of proposal (absent: 0)."""
        kinds = kinds or {}
        with_kinds = [(req, kinds.get(req.request_id, 0)) for req in candidates]
        picks = [(req, k, kind) for req, kind in with_kinds if (k := self.k_for(req.request_id, kind)) > 0]
        shape = sched.shape
        base = self.cost.predict(shape) if picks and shape is not None else None
        if shape is None or base is None or base <= 0.0:
            return [(req, k) for req, k, _ in picks]  # the cost model is still learning: every eligible row speculates
        tokens = float(len(sched.sampling))
        if not any(self._first_pays(base, req, kind, tokens) for req, _, kind in picks):
            self.declined_steps += 1  # a row's first proposal is its best: none beats the step
            return []
        items: list[Item] = []  # the j-th proposal of each pick
        for i, (req, cap, kind) in enumerate(picks):
            alpha = self._row(req.request_id, kind).alpha
            before = 0.0
            for j in range(1, cap + 1):
                extra = self.extra_seconds(req.num_computed_tokens, j)
                gain, seconds = alpha**j, extra - before
                before = extra
                items.append((gain / seconds if seconds > 0 else float("inf"), gain, seconds, i, j))
        items.sort(key=lambda it: (-it[0], it[4]))
        ks, order = self._take(items, len(picks), tokens, base)
        if not order:
            self.declined_steps += 1
        return [(picks[i][0], ks[i]) for i in order]

    def _take(self, items: list[Item], n: int, tokens: float, total: float) -> tuple[list[int], list[int]]:
        """Each pick's K, and the picks that speculate in the order they were taken: the items
        (rate, gain, seconds, pick, j), best first, while their gain per second beats the step's."""
        ks, order = [0] * n, []
        for rate, gain, seconds, i, j in items:
            if rate <= tokens / total:
                break
            if ks[i] != j - 1:  # (its earlier proposals priced dearer: a later one cannot come first)
                continue
            if j == 1:
                order.append(i)
            ks[i] = j
            tokens, total = tokens + gain, total + max(seconds, 0.0)
        return ks, order

    def _first_pays(self, base: float, req: Request, kind: int, tokens: float) -> bool:
        seconds = self.extra_seconds(req.num_computed_tokens, 1)
        return seconds <= 0.0 or self._row(req.request_id, kind).alpha / seconds > tokens / base

    def extra_seconds(self, computed: int, k: int) -> float:
        """What k proposals on a decode row after `computed` tokens add to a step: the step priced
        by its total rows, each checked token a row that computes its logits and samples as a decode
        row does (`SchedulerOutput.seal`), plus the K/V they read. The cost model is linear, so
        that is the rows' and the context's terms alone, whatever else the step holds."""
        coef = self.cost.coefficients
        if coef is None:
            return 0.0
        return coef[ROWS] * k + coef[CONTEXT] * (row_context(computed, 1 + k) - row_context(computed, 1))

    def observe(self, rid: str, proposed: int, accepted: int, kind: int = 0) -> None:
        """A speculated row's outcome: the averages of its kind of proposal, and a pause of that
        kind if they stay below the floor."""
        row = self._row(rid, kind)
        checked = accepted + (accepted < proposed)
        row.accepted += EMA * (accepted - row.accepted)
        row.checked += EMA * (checked - row.checked)
        a, c = self._prior.get(kind, (_Row.accepted, _Row.checked))
        self._prior[kind] = (a + PRIOR_EMA * (accepted - a), c + PRIOR_EMA * (checked - c))
        row.steps += 1
        if row.steps >= PROBATION and row.accepted < self.min_accepted:
            row.paused, row.pause_next = row.pause_next, min(MAX_PAUSE, row.pause_next * 2)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)

    def drop(self, rid: str) -> None:
        self._rows.pop(rid, None)

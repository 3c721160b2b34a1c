"""The step-budget hook every policy runs under: the latency targets of the requests running and
waiting decide each step's token budget (docs/latency-targets.md). Their classes: slo_class.py.

Every step, `LatencyBudget.plan` turns the targets into the step's limits with the step-cost
model (`step_cost.py`, `plan_step`); the scheduler then fills the step as its policy says,
within them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.step_cost import StepCostModel, StepShape, row_context

# The longest step, as a share of the smallest TTFT target of the requests seen: a request that
# arrives during one still has the rest of its target for its own (docs/latency-targets.md).
ARRIVAL_SHARE = 0.4
# Prompt tokens a step without decodes gets even when no prompt fits the time limit: the step is
# never empty while work waits (one KV block at the default block size).
MIN_PROMPT = 16


def ttft_deadline(req: Request) -> float | None:
    """When `req`'s first token is due, or None (no TTFT target)."""
    slo = req.slo
    return None if slo is None or slo.ttft_ms is None else req.times.arrival + slo.ttft_ms / 1000.0


def tpot_slack(req: Request, now: float) -> float | None:
    """Seconds the next step may take with `req` still on course for its TPOT target: after it,
    `req` will have k gaps between its k + 1 tokens, and their sum must stay within k x target
    (time banked by earlier fast steps counts). None without a TPOT target or a first token."""
    slo, first = req.slo, req.times.first_token
    if slo is None or slo.tpot_ms is None or first is None:
        return None
    return slo.tpot_ms / 1000.0 * len(req.output_token_ids) - (now - first)


@dataclass
class StepPlan:
    """The step's limits: `budget` tokens in all, of which untargeted prompt rows may take
    `untargeted_prompt` (None: no limit of their own); `sit_out`: untargeted decodes left out."""

    budget: int
    untargeted_prompt: int | None = None
    sit_out: set[str] = field(default_factory=set)
    limit_s: float | None = None  # the step time the TPOT targets allow (None: unconstrained)
    missed: list[Request] = field(default_factory=list)  # can no longer make their TTFT


def _target_s(req: Request) -> float:
    slo = req.slo
    return math.inf if slo is None or slo.tpot_ms is None else slo.tpot_ms / 1000.0


def _decode_shape(rows: Iterable[Request]) -> StepShape:
    rows = list(rows)
    return StepShape(0, len(rows), sum(row_context(r.num_computed_tokens, 1) for r in rows))


def _plus_prompt(shape: StepShape, tokens: int, computed: int) -> StepShape:
    return StepShape(shape.prompt_tokens + tokens, shape.decode_rows, shape.context + row_context(computed, tokens))


def plan_step(
    model: StepCostModel,
    now: float,
    decodes: list[Request],
    catching_up: list[Request],
    waiting: list[Request],
    max_tokens: int,
    arrival_limit: float | None = None,
) -> StepPlan:
    """The largest step that keeps every running request with a TPOT target on course.

    Its predicted time may not exceed the smallest `tpot_slack` of the targeted decodes (a
    request whose target is below the time of a step of targeted decodes alone cannot be helped
    by any step and is served best effort). Within that time, untargeted decodes go in unless
    the limit is shorter than the step of every decode, then the newest sit out first; targeted
    decodes always go in. The prompt tokens that still fit go first to targeted requests
    catching up and waiting (the scheduler orders them first), the rest to untargeted ones.
    `waiting`: the targeted requests waiting. `arrival_limit`: the longest step a request with a
    TTFT target may find running when it arrives (the prompt tokens are cut to keep within it,
    never the decodes). Also returns the targeted requests that can no
    longer make their TTFT even with full steps of their own (`missed`)."""
    targeted = [r for r in decodes if r.slo is not None and r.slo.targeted]
    demand = sum(r.num_tokens - r.num_computed_tokens for r in catching_up if r.slo is not None and r.slo.targeted)
    demand += sum(r.num_tokens - r.num_computed_tokens for r in waiting)
    plan = StepPlan(max_tokens)
    alone = _decode_shape(targeted)
    for r in waiting + [r for r in catching_up if r.slo is not None]:
        if not r.slo_missed and _cannot_make_ttft(model, r, alone, max_tokens, now):
            plan.missed.append(r)
    if model.coefficients is None:  # before the warm start: full steps, targeted prompts first
        plan.untargeted_prompt = max(0, max_tokens - len(decodes) - demand) if demand else None
        return plan
    floor = model.predict(alone) or 0.0
    slacks = [s for r in targeted if (s := tpot_slack(r, now)) is not None and _target_s(r) > floor]
    limit = max(min(slacks), floor) if slacks else math.inf
    plan.limit_s = None if limit == math.inf else limit
    # Untargeted decodes, newest last: drop from the end until the decode step fits.
    others = [r for r in decodes if r not in targeted]
    while others and (model.predict(_decode_shape(targeted + others)) or 0.0) > limit:
        plan.sit_out.add(others.pop().request_id)
    kept = _decode_shape(targeted + others)
    room = max_tokens - kept.decode_rows
    computed = catching_up[0].num_computed_tokens if catching_up else 0
    prompt = room
    if arrival_limit is not None:
        limit = min(limit, max(arrival_limit, model.predict(kept) or 0.0))
    if limit != math.inf:  # the largest prompt that fits in time (binary search: the cost is monotone)
        lo, hi = 0, room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (model.predict(_plus_prompt(kept, mid, computed)) or 0.0) <= limit:
                lo = mid
            else:
                hi = mid - 1
        prompt = lo if lo or kept.decode_rows else min(room, MIN_PROMPT)  # never an empty step
    plan.budget = kept.decode_rows + prompt
    if demand or limit != math.inf:
        plan.untargeted_prompt = max(0, prompt - demand)
    return plan


class LatencyBudget:
    """The step-budget hook: the step-cost model, and each step's plan from the targets of the
    requests it is given. Without a target in sight the plan is the whole budget, and nothing
    reads the model."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.cost = StepCostModel()
        # seconds: the longest step a request with a TTFT target may find running on arrival, a
        # share (`ARRIVAL_SHARE`) of the smallest TTFT target seen
        self.arrival_limit: float | None = None

    def arrived(self, req: Request) -> None:
        if req.slo is not None and req.slo.ttft_ms is not None:
            limit = req.slo.ttft_ms / 1000.0 * ARRIVAL_SHARE
            self.arrival_limit = limit if self.arrival_limit is None else min(self.arrival_limit, limit)

    def plan(
        self,
        now: float,
        decodes: list[Request],
        catching_up: list[Request],
        waiting: list[Request],
        targeted_running: bool,
    ) -> StepPlan:
        """The step's limits (`plan_step`) for these running `decodes` and `catching_up`,
        `waiting`: the targeted requests waiting; `targeted_running`: whether any running
        request has a target. The requests in `missed` are marked (`slo_missed`); refusing the
        ones whose class says so is the scheduler's."""
        if self.arrival_limit is None and not (waiting or targeted_running):
            return StepPlan(self.max_tokens)
        plan = plan_step(self.cost, now, decodes, catching_up, waiting, self.max_tokens, self.arrival_limit)
        for req in plan.missed:
            req.slo_missed = True
        return plan


def _cannot_make_ttft(model: StepCostModel, req: Request, alone: StepShape, max_tokens: int, now: float) -> bool:
    """Even with full steps of its prompt beside the targeted decodes alone, `req`'s first token
    would come after its TTFT deadline."""
    deadline = ttft_deadline(req)
    if deadline is None or req.times.first_token is not None:
        return False
    left, at, done = req.num_tokens - req.num_computed_tokens, req.num_computed_tokens, now
    while left > 0:
        n = min(left, max_tokens)
        done += model.predict(_plus_prompt(alone, n, at)) or 0.0
        left, at = left - n, at + n
    return done > deadline


def is_untargeted_prompt(req: Request) -> bool:
    """A row the plan's `untargeted_prompt` limits: no target, and more than a decode to compute."""
    untargeted = req.slo is None or not req.slo.targeted
    return untargeted and (
        req.num_tokens - req.num_computed_tokens > 1 or req.status != RequestStatus.RUNNING and not req.suspended
    )

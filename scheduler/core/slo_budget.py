"""Latency targets per class of traffic, and the step they decide (docs/latency-targets.md).

A class names a time-to-first-token target (`ttft_ms`), a time-per-output-token target
(`tpot_ms`, judged per request as the mean gap between its tokens), either or none, and whether
a request that can no longer make its TTFT is refused at once (`slo_reject`). Every step,
`plan_step` turns the targets of the requests running and waiting into the step's token budget
with the step-cost model (`step_cost.py`); the scheduler then fills the step as its policy says,
within that budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.step_cost import StepCostModel, StepShape, row_context

if TYPE_CHECKING:
    from orcaserve.scheduler.core.scheduler import Scheduler

_TARGETS = ("ttft_ms", "tpot_ms")
# Prompt tokens a step without decodes gets even when no prompt fits the time limit: the step is
# never empty while work waits (one KV block at the default block size).
MIN_PROMPT = 16


@dataclass(frozen=True)
class SloClass:
    """A class of traffic and its targets; no target means best effort."""

    name: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    reject: bool = False  # `slo_reject`: refuse (503) a request that can no longer make its TTFT

    @property
    def targeted(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def check_slo_classes(value: object) -> dict[str, SloClass]:
    """`slo_classes` as given: None, or a mapping of class name to {ttft_ms, tpot_ms, slo_reject}."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"slo_classes must map class names to targets, got {value!r}")
    classes = {}
    for name, spec in value.items():
        spec = {} if spec is None else spec
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            raise ValueError(f"slo_classes must map class names to targets, got {name!r}: {spec!r}")
        unknown = set(spec) - {*_TARGETS, "slo_reject"}
        if unknown:
            raise ValueError(
                f"slo_classes[{name!r}] has unknown keys {sorted(unknown)}; known: ttft_ms, tpot_ms, slo_reject"
            )
        for key in _TARGETS:
            ms = spec.get(key)
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < math.inf):
                raise ValueError(f"slo_classes[{name!r}].{key} must be a positive number of milliseconds, got {ms!r}")
        reject = spec.get("slo_reject", False)
        if not isinstance(reject, bool):
            raise ValueError(f"slo_classes[{name!r}].slo_reject must be true or false, got {reject!r}")
        ttft, tpot = spec.get("ttft_ms"), spec.get("tpot_ms")
        classes[name] = SloClass(
            name, None if ttft is None else float(ttft), None if tpot is None else float(tpot), reject
        )
    return classes


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


def plan_for(
    s: Scheduler, decodes: list[Request], catching_up: list[Request], now: float, classed: bool = True
) -> StepPlan:
    """Plan `s`'s step from the latency targets of its requests and set its limits (the policy
    surface's `limit_step`); a waiting request that can no longer make its TTFT is marked, and
    refused (`s.rejected`) when its class says so and it has not started. `classed`: False when
    no running request has a class (none then has a target to look for)."""
    waiting = s.waiting.targeted()
    most = s.max_num_batched_tokens
    targeted = classed and any(r.targeted for r in s.running.values())
    if s.arrival_limit is None and not (waiting or targeted):
        plan = StepPlan(most)
    else:
        plan = plan_step(s.cost, now, decodes, catching_up, waiting, most, s.arrival_limit)
    s.limit_step(plan.budget, plan.untargeted_prompt)
    for req in plan.missed:
        req.slo_missed = True
        fresh = req.status == RequestStatus.WAITING and req.times.first_scheduled is None
        if req.slo is not None and req.slo.reject and fresh:
            s.finish_request(req, "rejected")
            s.rejected.append(req)
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

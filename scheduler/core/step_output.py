"""One step's batch as the scheduler decided it (scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.step_cost import StepShape, row_context

if TYPE_CHECKING:
    from orcaserve.scheduler.spec.verify import DraftRun


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run and how many of their tokens each feeds."""

    # request -> tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # the same requests in the same order (the two change together: RunningBatch._give, take_back)
    requests: dict[str, Request] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # Requests whose scheduled tokens reach the end of their sequence: they sample a token this
    # step, in batch order. Decided once (`seal`); the runner and the engine read it.
    sampling: list[Request] = field(default_factory=list)
    # What the step computes, in the step-cost model's terms (`seal`; None where nothing reads it).
    shape: StepShape | None = None
    # Speculative decoding: request -> its proposed tokens this step (spec/decoding.py); such a
    # row appears 1 + K times in `sampling`, once per checked position.
    spec: dict[str, list[int]] = field(default_factory=dict)
    # Those of a sampled row with the draft model's distributions: checked by the general rule.
    drafted: dict[str, DraftRun] = field(default_factory=dict)

    def seal(self, shape: bool = True) -> None:
        """The batch is decided (`Scheduler.schedule`): one pass over it sets `sampling` and, when
        asked for (`shape`: the step-cost model reads it), `shape`."""
        sampling = self.sampling
        if not shape:
            for req, n in zip(self.requests.values(), self.num_scheduled_tokens.values()):  # (one order)
                if req.num_computed_tokens + n == len(req.all_token_ids):
                    sampling.append(req)
            return
        prompt = decode = 0
        context = 0.0
        spec = self.spec
        for (rid, req), n in zip(self.requests.items(), self.num_scheduled_tokens.values()):
            computed = req.num_computed_tokens
            if computed + n == len(req.all_token_ids):
                sampling.append(req)
            if n == 1 and computed >= len(req.prompt_token_ids):
                decode += 1
                context += (computed + 1.0) / 1000.0  # row_context(computed, 1), the same float
            elif rid in spec:  # a verifying row: each of its 1 + K tokens computes its logits and samples
                decode += n
                context += row_context(computed, n)
            else:
                prompt += n
                context += row_context(computed, n)
        self.shape = StepShape(prompt, decode, context)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def subset(self, request_ids: list[str]) -> SchedulerOutput:
        """The same step restricted to `request_ids` (to re-run part of a batch that failed)."""
        keep = set(request_ids)
        return SchedulerOutput(
            num_scheduled_tokens={r: n for r, n in self.num_scheduled_tokens.items() if r in keep},
            requests={r: req for r, req in self.requests.items() if r in keep},
            sampling=[req for req in self.sampling if req.request_id in keep],
            spec={r: d for r, d in self.spec.items() if r in keep},
            drafted={r: d for r, d in self.drafted.items() if r in keep},
        )

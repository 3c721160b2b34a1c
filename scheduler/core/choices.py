"""`n` choices of one request: sequences of their own that share the prompt's KV blocks.

A request with `n > 1` becomes n requests (`<id>#<i>`) that the scheduler treats like any other;
their outputs carry the parent's id and the choice's index. Only the first is scheduled at once;
the others wait here until its prompt is computed, then find the prompt's full blocks in the
prefix cache and compute only the last, partial block (docs/kv-cache.md, "n choices of one
request"). Without prefix caching they are all scheduled at once, and each computes the prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.sampling_params import SamplingParams

_SEEDS = 1 << 64


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: one sequence, seeded `seed + index` (vLLM's rule), so a seeded
    request gives the same n answers every time and choice 0 is the answer of `n=1`."""
    seed = None if params.seed is None else (params.seed + index) % _SEEDS
    return dataclasses.replace(params, n=1, seed=seed)


class Choices:
    """The requests of every request with `n > 1` that has a choice not yet finished."""

    def __init__(self) -> None:
        self._groups: dict[str, list[Request]] = {}  # parent id -> its choices, by index
        self._held: dict[str, list[Request]] = {}  # parent id -> choices waiting for the prompt

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def split(
        self, request_id: str, params: SamplingParams, make: Callable[[str, SamplingParams], Request], share: bool
    ) -> tuple[list[Request], list[Request]]:
        """The n choices of a request (`make(id, params)` builds one): (to schedule now, all)."""
        choices = []
        for i in range(params.n):
            req = make(f"{request_id}#{i}", choice_params(params, i))
            req.group_id, req.index = request_id, i
            choices.append(req)
        self._groups[request_id] = choices
        if not share:
            return choices, choices
        self._held[request_id] = choices[1:]
        return choices[:1], choices

    def requests(self) -> list[Request]:
        """Every choice of every request with one unfinished (a LoRA adapter still in use: lora/runtime.py)."""
        return [r for group in self._groups.values() for r in group]

    def members(self, request_id: str) -> list[Request] | None:
        return self._groups.get(request_id)

    def release(self) -> list[Request]:
        """Choices whose first choice has computed its prompt (or finished): schedule them now."""
        ready: list[Request] = []
        for rid, held in list(self._held.items()):
            first = self._groups[rid][0]
            if first.status == RequestStatus.FINISHED or first.num_computed_tokens >= first.num_prompt_tokens:
                ready += held
                del self._held[rid]
        return ready

    def take_held(self, request_id: str) -> list[Request]:
        """The choices of `request_id` not yet scheduled, forgotten here (an abort ends them)."""
        return self._held.pop(request_id, [])

    def finished(self, req: Request) -> None:
        """Forget a request whose choices have all finished."""
        group = self._groups.get(req.group_id)
        if group is not None and all(r.status == RequestStatus.FINISHED for r in group):
            del self._groups[req.group_id]
            self._held.pop(req.group_id, None)

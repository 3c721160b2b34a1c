"""Requests held out of the scheduler while their prompt's log-probabilities are computed.

A request with `prompt_logprobs` (OpenAI's `echo` with `logprobs`) needs a forward of its whole
prompt of its own (model/prompt_logprobs.py). Run at once it held the engine thread for seconds
(39 s for 2,048 tokens on 2 vCPUs) and every other stream waited. Instead the engine advances the
oldest job by one chunk per step, beside the normal batch, and schedules the job's requests when
it is done (docs/performance-log.md#log-probabilities-and-echo-what-they-cost). Jobs run one after another (FIFO),
so only one holds a scratch cache at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from orcaserve.scheduler.core.request import Request


class PromptJob(Protocol):
    """A resumable computation (`PromptLogprobs`): `advance()` does one bounded chunk and returns
    whether it is done; `result` is what the requests get."""

    result: list

    def advance(self) -> bool: ...


@dataclass
class HeldRequest:
    """One request's job, what gets its result (all its choices) and what to schedule after."""

    job: PromptJob
    receivers: list[Request]
    to_schedule: list[Request]


class PromptJobs:
    """The held requests, by request id (a request with n choices: its parent id), oldest first."""

    def __init__(self) -> None:
        self._held: dict[str, HeldRequest] = {}  # insertion order: FIFO

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_requests(self) -> int:
        """Requests waiting for their job (the `waiting` gauge counts them)."""
        return sum(len(held.to_schedule) for held in self._held.values())

    def requests(self) -> list[Request]:
        """Every request held (a LoRA adapter still in use: lora/runtime.py)."""
        return [r for held in self._held.values() for r in (*held.receivers, *held.to_schedule)]

    def hold(self, request_id: str, job: PromptJob, receivers: list[Request], to_schedule: list[Request]) -> None:
        self._held[request_id] = HeldRequest(job, receivers, to_schedule)

    def drop(self, request_id: str) -> list[Request]:
        """Forget `request_id`'s job (an abort); the requests it held, never scheduled."""
        held = self._held.pop(request_id, None)
        return held.to_schedule if held is not None else []

    def advance(self) -> tuple[str, HeldRequest, Exception | None] | None:
        """One chunk of the oldest job. When that job ends: (its id, what it held, None) with the
        result handed to its receivers, or (id, held, the error) when the chunk raised; the job is
        forgotten either way. None while it goes on, or when nothing is held."""
        if not self._held:
            return None
        request_id, held = next(iter(self._held.items()))
        try:
            done = held.job.advance()
        except Exception as e:  # this request fails alone (the engine answers it)
            del self._held[request_id]
            return request_id, held, e
        if not done:
            return None
        del self._held[request_id]
        for req in held.receivers:
            req.prompt_logprobs = held.job.result
        return request_id, held, None

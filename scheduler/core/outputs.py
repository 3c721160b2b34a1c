"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orcaserve.scheduler.core.token_logprob import TokenLogprob


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock timestamps (time.time()) of a request's life; None until reached."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def snapshot(self) -> RequestTimes:
        """A copy for an output: the engine thread keeps writing this one."""
        return RequestTimes(self.arrival, self.first_scheduled, self.first_token, self.finished)


@dataclass(slots=True)
class RequestOutput:
    """Incremental output of one request.

    `new_token_ids` and `new_text` cover what was produced since this request's previous output.
    The final output (`finished`) also carries the whole answer in `output_token_ids` and `text`;
    earlier ones leave them empty, so a long answer is not copied again at every step. `text`
    never contains a stop string, and while a request runs `new_text` holds back any tail that
    could still become one. `new_logprobs` and `logprobs` follow the same rule for the tokens'
    log-probabilities, when the request asked for them (`SamplingParams.logprobs`); else None.
    """

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]  # the whole answer, on the final output only
    new_text: str
    text: str  # the whole answer, on the final output only
    finished: bool
    # "stop" | "length" | "abort" | "timeout" (deadline) | "error" (see `error`) | None while running
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    times: RequestTimes
    num_preemptions: int = 0
    # Prompt tokens whose K/V came from the prefix cache at admission (not computed for this request).
    num_cached_tokens: int = 0
    error: str | None = field(default=None)  # why the engine failed the request (finish_reason "error")
    new_logprobs: list[TokenLogprob] | None = None  # one per new token
    logprobs: list[TokenLogprob] | None = None  # one per output token, on the final output only
    index: int = 0  # which of the request's `n` choices this output is about
    # The prompt's tokens and their log-probabilities (None first), when the request asked for them
    # (`SamplingParams.prompt_logprobs`): on a choice's first output and on its final one.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

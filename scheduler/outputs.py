"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.time()) of a request's life; None until reached."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    """Incremental output of one request.

    `new_token_ids` and `new_text` cover what was produced since this request's previous output;
    `output_token_ids` and `text` everything so far. `text` never contains a stop string, and
    while a request runs it holds back any tail that could still become one.
    """

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    # "stop" | "length" | "abort" | "timeout" (deadline) | "error" (see `error`) | None while running
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    times: RequestTimes
    num_preemptions: int = 0
    error: str | None = field(default=None)  # why the engine failed the request (finish_reason "error")

"""Why the engine failed a request, as types; what a client is told is the serving layer's choice
(the OpenAI handler maps these in `orcaserve.handler.openai.errors`)."""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """A request failed; `message` says why, for the client. `retry_after`: seconds after which
    the same request may succeed, or None when no retry is suggested. `reason`: the error's kind
    as a metric label (a request refused before it ran is counted by it, docs/serving.md
    "Limits and refusals")."""

    retry_after: int | None = None
    reason: ClassVar[str] = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as given; raised where the check is made. `param` names the
    offending parameter in the engine's terms (a SamplingParams field, `prompt`, `messages`,
    `priority`, `cache_salt`), or None. A ValueError too, for callers of the Python API."""

    reason: ClassVar[str] = "invalid"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt leaves no room for a generated token within `max_model_len`."""

    reason: ClassVar[str] = "too_long"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="prompt")


class UnknownModel(InvalidRequest):
    """The request names a LoRA adapter (`EngineRequest.lora`) the engine does not serve. Over HTTP
    a 404 with OpenAI's `model_not_found` code (handler/openai/errors.py)."""

    reason: ClassVar[str] = "unknown_model"

    def __init__(self, name: str, known: list[str]) -> None:
        served = ", ".join(sorted(known)) or "none"
        super().__init__(f"the model {name!r} does not exist (LoRA adapters served: {served})", param="lora")
        self.name = name


class Overloaded(EngineError):
    """Too many requests are waiting; `retry_after` is a hint in seconds."""

    reason: ClassVar[str] = "overloaded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TargetUnreachable(Overloaded):
    """The request's class refuses (`slo_reject`) what can no longer make its time-to-first-token
    target; another replica may (docs/latency-targets.md)."""

    reason: ClassVar[str] = "target_unreachable"

    def __init__(self, retry_after: int = 1) -> None:
        super().__init__(
            "the server cannot meet this request's time-to-first-token target now; retry later or elsewhere",
            retry_after,
        )


class TimedOut(EngineError):
    """The request's deadline (`timeout` seconds after submission) passed before its first token."""

    reason: ClassVar[str] = "timed_out"

    def __init__(self, timeout: float) -> None:
        super().__init__(f"request timed out after {timeout:g} s before its first token")
        self.timeout = timeout


class ShuttingDown(EngineError):
    """The engine is stopping or stopped; another may serve the request after `retry_after` s."""

    reason: ClassVar[str] = "shutting_down"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InternalError(EngineError):
    """A bug or a failure the request did not cause. `retry_after` is set where a retry may
    succeed (the engine stopped; a replacement may serve it)."""

    reason: ClassVar[str] = "internal"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

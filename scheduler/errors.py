"""Why the engine failed a request, as types; what a client is told is the serving layer's choice
(the OpenAI handler maps these in `orcaserve.handler.openai.errors`)."""

from __future__ import annotations

import dataclasses

from orcaserve.scheduler.sampling_params import SamplingParams

# What a request gives the engine: the prompt (`prompt`, or a chat's `messages`), the
# `Engine.add_request` arguments and the SamplingParams fields. Validation messages
# (SamplingParams, `encode_prompt`, `Engine.add_request`) start with the offending one's name.
PARAMETERS = frozenset(
    {"prompt", "messages", "priority", "cache_salt", "slo_class"} | {f.name for f in dataclasses.fields(SamplingParams)}
)


class EngineError(Exception):
    """A request failed; `message` says why, for the client. `retry_after`: seconds after which
    the same request may succeed, or None when no retry is suggested."""

    retry_after: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    """The request cannot be served as given. `param` names the offending parameter in the
    engine's terms (one of PARAMETERS: a SamplingParams field, `prompt`, ...), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_message(cls, message: str) -> InvalidRequest:
        """From a validation message (a ValueError's): `param` is its first word where that names
        a parameter."""
        first = message.split(" ", 1)[0]
        return cls(message, first if first in PARAMETERS else None)


class Overloaded(EngineError):
    """Too many requests are waiting; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TargetUnreachable(Overloaded):
    """The request's class refuses (`slo_reject`) what can no longer make its time-to-first-token
    target; another replica may (docs/latency-targets.md)."""

    def __init__(self, retry_after: int = 1) -> None:
        super().__init__(
            "the server cannot meet this request's time-to-first-token target now; retry later or elsewhere",
            retry_after,
        )


class TimedOut(EngineError):
    """The request's deadline (`timeout` seconds after submission) passed before its first token."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"request timed out after {timeout:g} s before its first token")
        self.timeout = timeout


class ShuttingDown(EngineError):
    """The engine is stopping or stopped; another may serve the request after `retry_after` s."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InternalError(EngineError):
    """A bug or a failure the request did not cause. `retry_after` is set where a retry may
    succeed (the engine stopped; a replacement may serve it)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

"""The one mapping from the engine's errors (`orcaserve.scheduler.errors`) to what an OpenAI
client is told: HTTP status, OpenAI error object (message, type, param, code) and Retry-After."""

from __future__ import annotations

from dataclasses import dataclass

from orcaserve.handler.openai.protocol import error_body
from orcaserve.scheduler.errors import EngineError, InvalidRequest, Overloaded, ShuttingDown, TimedOut

# Engine parameter names that the OpenAI API spells differently. None today: SamplingParams
# follows the API's names (max_tokens, top_p, ...) and `prompt`, `messages`, `priority` and
# `cache_salt` are the request fields of the same names.
_OPENAI_PARAM: dict[str, str] = {}

# A TimedOut is the request's `timeout` field (an orcaserve extension) running out.
_TIMEOUT_PARAM = "timeout"


@dataclass(frozen=True)
class HttpError:
    """What a client is told about a failed request."""

    status: int
    body: dict  # OpenAI's `{"error": {"message", "type", "param", "code"}}`
    retry_after: int | None = None  # the Retry-After header, in seconds


def openai_param(name: str | None) -> str | None:
    """The OpenAI request field for an engine parameter name."""
    return None if name is None else _OPENAI_PARAM.get(name, name)


def http_error(e: EngineError) -> HttpError:
    """The HTTP answer to a request the engine failed with `e`: 400 InvalidRequest, 408 TimedOut,
    503 Overloaded or ShuttingDown, 500 InternalError (and any other EngineError)."""
    if isinstance(e, InvalidRequest):
        return HttpError(400, error_body(e.message, openai_param(e.param)))
    if isinstance(e, TimedOut):
        return HttpError(408, error_body(e.message, _TIMEOUT_PARAM, "timeout_error"))
    if isinstance(e, (Overloaded, ShuttingDown)):
        return HttpError(503, error_body(e.message, None, "server_error"), e.retry_after)
    return HttpError(500, error_body(e.message, None, "server_error"), e.retry_after)

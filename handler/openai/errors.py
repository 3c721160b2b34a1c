"""The one path from a failed request to what an OpenAI client is told: HTTP status, OpenAI error
object (message, type, param, code) and Retry-After (docs/serving.md, "Where the protocol lives").

Every failure takes it: a request the protocol layer refuses (`ProtocolError`), an error the
engine answered with (`orcaserve.scheduler.errors`), and anything unexpected (500). How the
answer travels (a real status, or in-band once a stream's 200 went out) is the TorchServe
layer's `Reply.fail`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orcaserve.scheduler.errors import EngineError, InvalidRequest, Overloaded, ShuttingDown, TimedOut, UnknownModel


class ProtocolError(Exception):
    """A request the server refuses; becomes an OpenAI error body with `status`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(
    message: str, param: str | None = None, type_: str = "invalid_request_error", code: str | None = None
) -> dict:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` (`code` e.g.
    `model_not_found`, else null)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Engine parameter names that the OpenAI API spells differently: the LoRA adapter (`lora`) is the
# `model` field. SamplingParams follows the API's names (max_tokens, top_p, ...) and `prompt`,
# `messages`, `priority` and `cache_salt` are the request fields of the same names.
_OPENAI_PARAM: dict[str, str] = {"lora": "model"}  # the adapter is named by `model` (docs/lora.md)


def openai_param(name: str | None) -> str | None:
    """The OpenAI request field for an engine parameter name."""
    return None if name is None else _OPENAI_PARAM.get(name, name)


def _no_param(e: EngineError) -> str | None:
    return None


# Engine error type -> (HTTP status, OpenAI error type, the request field it names); the first
# row `e` is an instance of wins. A TimedOut is the request's `timeout` field (an orcaserve
# extension) running out. Retry-After is the error's own `retry_after`. An unknown model (a LoRA
# adapter not served) is OpenAI's 404 with code `model_not_found` (`_CODES`).
_ENGINE_ERRORS: tuple[tuple[type[EngineError], int, str, Callable[[EngineError], str | None]], ...] = (
    (UnknownModel, 404, "invalid_request_error", lambda e: "model"),
    (InvalidRequest, 400, "invalid_request_error", lambda e: openai_param(getattr(e, "param", None))),
    (TimedOut, 408, "timeout_error", lambda e: "timeout"),
    (Overloaded, 503, "server_error", _no_param),  # TargetUnreachable too
    (ShuttingDown, 503, "server_error", _no_param),
    (EngineError, 500, "server_error", _no_param),  # InternalError, and any other
)

_CODES: dict[type[EngineError], str] = {UnknownModel: "model_not_found"}


@dataclass(frozen=True)
class HttpError:
    """What a client is told about a failed request."""

    status: int
    body: dict  # OpenAI's `{"error": {"message", "type", "param", "code"}}`
    retry_after: int | None = None  # the Retry-After header, in seconds


def http_error(e: BaseException) -> HttpError:
    """The HTTP answer to a request that failed with `e`: a ProtocolError's own status (400, 404,
    413); 404 UnknownModel (`model_not_found`), 400 InvalidRequest, 408 TimedOut, 503 Overloaded
    or ShuttingDown, 500 InternalError and any other EngineError; 500 naming the exception for
    anything else (a bug)."""
    if isinstance(e, ProtocolError):
        return HttpError(e.status, e.body())
    if isinstance(e, EngineError):
        for cls, status, type_, param in _ENGINE_ERRORS:
            if isinstance(e, cls):
                return HttpError(status, error_body(e.message, param(e), type_, _CODES.get(cls)), e.retry_after)
    return HttpError(500, error_body(f"internal error: {type(e).__name__}: {e}", None, "server_error"))

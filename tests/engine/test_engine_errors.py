"""The engine's typed errors and the one mapping of them to HTTP answers (handler/openai/errors.py)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from orcaserve.handler.openai.errors import HttpError, http_error
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.errors import EngineError, InternalError, InvalidRequest, Overloaded, ShuttingDown, TimedOut


def _body(message: str, param: str | None, type_: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            InvalidRequest("top_p must be in (0, 1], got 2.0", "top_p"),
            HttpError(400, _body("top_p must be in (0, 1], got 2.0", "top_p", "invalid_request_error")),
        ),
        (
            InvalidRequest("request id 'a' is already in flight"),
            HttpError(400, _body("request id 'a' is already in flight", None, "invalid_request_error")),
        ),
        (
            TimedOut(1.5),
            HttpError(408, _body("request timed out after 1.5 s before its first token", "timeout", "timeout_error")),
        ),
        (
            Overloaded("server overloaded: 2 requests are already waiting", retry_after=1),
            HttpError(503, _body("server overloaded: 2 requests are already waiting", None, "server_error"), 1),
        ),
        (
            ShuttingDown("the engine is shutting down", retry_after=5),
            HttpError(503, _body("the engine is shutting down", None, "server_error"), 5),
        ),
        (
            ShuttingDown("the engine is not running"),
            HttpError(503, _body("the engine is not running", None, "server_error")),
        ),
        (
            InternalError("internal error: RuntimeError: injected"),
            HttpError(500, _body("internal error: RuntimeError: injected", None, "server_error")),
        ),
        (
            InternalError("the engine stopped after an internal error: _Boom", retry_after=5),
            HttpError(500, _body("the engine stopped after an internal error: _Boom", None, "server_error"), 5),
        ),
        (EngineError("something else"), HttpError(500, _body("something else", None, "server_error"))),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, EngineError) else "",
)
def test_each_engine_error_maps_to_its_status_body_and_retry_after(error, expected):
    assert http_error(error) == expected
    assert str(error) == error.message


def test_a_validation_error_names_its_engine_parameter():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(top_p=2.0)
    e = err.value
    assert isinstance(e, ValueError)
    assert e.param == "top_p" and e.message == str(e) == "top_p must be in (0, 1], got 2.0"
    assert http_error(e).body["error"]["param"] == "top_p"
    for kwargs, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"seed": 1 << 64}, "seed"),
    ):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(**kwargs)
        assert err.value.param == param, kwargs
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_dict({"bogus": 1})
    assert err.value.param is None


def test_the_engine_speaks_no_http():
    """scheduler/ imports nothing from handler/ and names no OpenAI error type or HTTP header."""
    root = pathlib.Path(__file__).resolve().parents[2] / "scheduler"
    for path in root.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("orcaserve.handler"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("orcaserve.handler") for a in node.names), path
        for word in ("invalid_request_error", "server_error", "timeout_error", "Retry-After"):
            assert word not in source, f"{path} names {word!r}"

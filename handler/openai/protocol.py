"""OpenAI-shaped request parsing, independent of TorchServe.

Parsing turns a decoded JSON body into a `ParsedRequest` (the `EngineRequest` the engine serves,
plus how the answer is shaped) or raises `ProtocolError` carrying the HTTP status and OpenAI error
fields. The answers' shapes are in `responses.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orcaserve.handler.openai import structured, tools
from orcaserve.handler.openai.errors import ProtocolError
from orcaserve.handler.openai.fields import CHAT, COMPLETIONS, MODELS, check_fields
from orcaserve.handler.reasoning import template_kwargs
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import InvalidRequest
from orcaserve.scheduler.prompt import ChatPrompt, Prompt
from orcaserve.scheduler.sampling_params import MAX_LOGPROBS, MAX_N, RequestOutputKind, SamplingParams

_ROLES = {"system", "user", "assistant", "developer", "tool"}
# Reason phrases for the statuses the handlers answer with.
HTTP_PHRASES = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class ParsedRequest:
    """One parsed request: what the engine serves (`request`; its tenant, cache salt and latency
    class come from the gateway's headers: `tenancy.with_tenancy`) and how the answer is shaped."""

    kind: str  # COMPLETIONS | CHAT
    request: EngineRequest  # chat: the messages as its prompt, rendered at admission
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    cache_salt: str | None = None  # as the client sent it; the engine's salt is derived from it
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the answer
    ignored: tuple[str, ...] = ()  # OpenAI fields the request sent that orcaserve does not act on
    tool_spec: tools.ToolSpec | None = None  # chat: the tools and how the answer calls them (tools.py)

    @property
    def prompt(self) -> Prompt:
        return self.request.prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params


def route(url_path: str | None) -> str:
    """Which API a URL suffix (TorchServe's `url_path` header) selects."""
    path = (url_path or "").strip("/")
    if path in ("v1/models", "models"):
        return MODELS
    if path in ("", "v1/completions", "completions"):
        return COMPLETIONS
    if path in ("v1/chat/completions", "chat/completions"):
        return CHAT
    raise ProtocolError(
        f"unknown path {url_path!r}; use v1/completions, v1/chat/completions or v1/models",
        None,
        404,
        "not_found_error",
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _expect(body: dict, name: str, check: Callable[[Any], bool], what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise ProtocolError(f"{name} must be {what}, got {value!r}", name)
    return value


def _parse_prompt(prompt: Any) -> str | list[int]:
    # OpenAI also accepts a batch (list of strings / of token lists); one prompt per request here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise ProtocolError("prompt is empty", "prompt")
        return list(prompt)
    raise ProtocolError("prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def _parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ProtocolError(f"messages[{i}] must be an object with role in {sorted(_ROLES)}", "messages")
        if m["role"] == "tool" or m.get("tool_calls"):  # tool results and calls (tools.py)
            out.append(tools.tool_message(i, m))
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ProtocolError(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise ProtocolError("prompt is required", "prompt")
    return _parse_prompt(body["prompt"])


def _is_count(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_LOGPROBS


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no log-probabilities.
    Completions ask with `logprobs: k`; chat with `logprobs: true` and `top_logprobs: k`."""
    what = f"an integer from 0 to {MAX_LOGPROBS}"
    if kind == COMPLETIONS:
        return _expect(body, "logprobs", _is_count, what)
    top = _expect(body, "top_logprobs", _is_count, what)
    if not _expect(body, "logprobs", lambda v: isinstance(v, bool), "a boolean"):
        if top is not None:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _logit_bias(body: dict) -> dict[int, Any]:
    """OpenAI's `logit_bias`: token ids as JSON keys (decimal strings) to biases; the values'
    range and the ids' vocabulary are checked by SamplingParams and the engine."""
    bias = _expect(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token ids to numbers") or {}
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise ProtocolError(f"logit_bias keys must be token ids (decimal integers), got {key[:32]!r}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def _chat_prompt(body: dict, tool_spec: tools.ToolSpec | None) -> ChatPrompt:
    messages = _parse_messages(body.get("messages"))
    # rendered at admission, off the threads other requests wait for
    kwargs = template_kwargs(body.get("chat_template_kwargs"))  # e.g. enable_thinking (handler/reasoning.py)
    return ChatPrompt(messages, tool_spec.tools if tool_spec is not None else None, kwargs)


def _max_tokens(body: dict, kind: str, default: int | None, limit: int | None) -> int:
    name = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        # OpenAI: 16 for completions; chat runs until EOS or the context is full.
        value = default or (16 if kind == COMPLETIONS else 1 << 30)
        return min(value, limit or value)
    if not _is_int(value) or value < 1:
        raise ProtocolError(f"{name} must be a positive integer, got {value!r}", name)
    if limit is not None and value > limit:
        raise ProtocolError(f"{name} must be at most {limit} on this server (max_tokens_limit), got {value}", name)
    return value


def _sampling_params(
    body: dict, max_tokens: int, logprobs: int | None, n: int = 1, prompt_logprobs: int | None = None
) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ProtocolError("stop must be a non-empty string or a list of up to 4 of them", "stop")
    _expect(body, "stop_token_ids", lambda v: isinstance(v, list), "a list of integers")
    values = {
        "max_tokens": max_tokens,
        "stop": stop or [],
        "logprobs": logprobs,
        "logit_bias": _logit_bias(body),
        "n": n,
        "prompt_logprobs": prompt_logprobs,  # echo with logprobs: the prompt's too
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "ignore_eos",
        "stop_token_ids",
        "num_speculative_tokens",  # extension: 0 turns speculative decoding off for this request
    ):
        if body.get(name) is not None:
            values[name] = body[name]
    try:
        return SamplingParams(**values)
    except InvalidRequest as e:
        raise ProtocolError(e.message, e.param if e.param in values else None) from None
    except (ValueError, TypeError) as e:
        raise ProtocolError(str(e), None) from None


def parse_request(
    body: dict,
    kind: str,
    default_timeout: float | None = None,
    default_max_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    request_id: str = "",
) -> ParsedRequest:
    """Validate an OpenAI Completions / Chat Completions body; raises ProtocolError (400).

    `max_tokens_limit` caps what a request may ask for (400 above it) and the default; a
    request's `timeout` is capped by `default_timeout`. `request_id` names the `EngineRequest`
    built here (a per-request field the body carries is read here: docs/engine.md, "Where a
    per-request field goes")."""
    ignored = check_fields(body, kind)
    try:  # structured outputs and tool calls (structured.py, tools.py)
        constraint, tool_spec = tools.request_constraints(body)
        prompt = _completion_prompt(body) if kind == COMPLETIONS else _chat_prompt(body, tool_spec)
    except structured.FieldError as e:
        raise ProtocolError(str(e), e.param) from None
    n = _expect(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer from 1 to {MAX_N}") or 1
    # best_of: the best n of best_of by the answers' log-probability; only best_of == n (no choice
    # to make) is served.
    if body.get("best_of") not in (None, n):
        raise ProtocolError("best_of is supported only equal to n", "best_of")
    echo = _expect(body, "echo", lambda v: isinstance(v, bool), "a boolean") or False
    _expect(body, "model", lambda v: isinstance(v, str), "a string")
    stream = _expect(body, "stream", lambda v: isinstance(v, bool), "a boolean") or False
    opts = (
        _expect(
            body,
            "stream_options",
            lambda v: (
                isinstance(v, dict) and set(v) <= {"include_usage"} and isinstance(v.get("include_usage", False), bool)
            ),
            "{'include_usage': bool}",
        )
        or {}
    )
    if opts and not stream:
        raise ProtocolError("stream_options needs stream: true", "stream_options")
    priority = _expect(body, "priority", _is_int, "an integer") or 0
    cache_salt = _expect(body, "cache_salt", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    timeout = _expect(body, "timeout", lambda v: _is_number(v) and v > 0, "a positive number of seconds")
    if timeout is None or (default_timeout is not None and timeout > default_timeout):
        timeout = default_timeout  # the server's deadline is also the longest a client may ask for
    max_tokens = _max_tokens(body, kind, default_max_tokens, max_tokens_limit)
    logprobs = _logprobs(body, kind)
    params = _sampling_params(body, max_tokens, logprobs, n, logprobs if echo else None)
    params.structured_outputs = constraint
    # A client answered once the request finished reads its final output alone.
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    request = EngineRequest(request_id, prompt, params, priority=priority, timeout=timeout)
    return ParsedRequest(
        kind, request, stream, bool(opts.get("include_usage")), body.get("model"), cache_salt, echo, ignored, tool_spec
    )

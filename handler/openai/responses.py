"""OpenAI-shaped answers: `text_completion` / `chat.completion` objects, their streaming chunks
and Server-Sent Events."""

from __future__ import annotations

import json
import time

from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.protocol import COMPLETIONS
from orcaserve.scheduler.errors import EngineError


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` (prompt tokens served from the
    prefix cache) when the server reports it (the request-level baseline has no cache)."""
    usage: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def response_id(kind: str, request_id: str) -> str:
    return ("cmpl-" if kind == COMPLETIONS else "chatcmpl-") + request_id


def final_response(
    kind: str,
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    created: int | None = None,
    cached_tokens: int | None = None,
    logprobs: dict | None = None,
) -> dict:
    """The non-streamed `text_completion` or `chat.completion` object (`logprobs`: the choice's,
    already in its API's shape)."""
    created = created or int(time.time())
    if kind == COMPLETIONS:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    return {
        "id": response_id(kind, request_id),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def stream_chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    usage: tuple[int, int] | tuple[int, int, int] | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One OpenAI streaming chunk; `usage` set gives the trailing usage-only chunk (no choices):
    (prompt, completion) tokens, or (prompt, completion, cached prompt) tokens."""
    obj = "text_completion" if kind == COMPLETIONS else "chat.completion.chunk"
    chunk: dict = {"id": response_id(kind, request_id), "object": obj, "created": created, "model": model}
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = _usage(*usage)
        return chunk
    if kind == COMPLETIONS:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk["choices"] = [choice]
    return chunk


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying a JSON object (or the literal `[DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def engine_error_body(e: EngineError) -> dict:
    """OpenAI's error object for an error the engine answered a request with (`errors.py`)."""
    return http_error(e).body

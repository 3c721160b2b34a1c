"""OpenAI-shaped answers: `text_completion` / `chat.completion` objects, their streaming chunks
and Server-Sent Events."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from orcaserve.handler.openai.protocol import COMPLETIONS


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
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


# The engine's finish reasons that are not OpenAI's, and the one a client is told instead: a
# deadline or an abort cut the answer short, as `max_tokens` does (docs/api.md#fields).
# "error" never reaches a choice: the request is answered with an error object instead.
_FINISH_REASONS = {"timeout": "length", "abort": "length"}


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as one of OpenAI's (`stop`, `length`, `tool_calls`,
    `content_filter`)."""
    return _FINISH_REASONS.get(reason, reason) if reason is not None else None


def choice(kind: str, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One choice of a non-streamed answer (`logprobs` already in its API's shape)."""
    reason = openai_finish_reason(finish_reason)
    if kind == COMPLETIONS:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


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
    """The non-streamed `text_completion` or `chat.completion` object of one choice."""
    choices = [choice(kind, 0, text, finish_reason, logprobs)]
    return response_of(
        kind, request_id, model, choices, usage_of(prompt_tokens, completion_tokens, cached_tokens), created
    )


def response_of(
    kind: str, request_id: str, model: str, choices: list[dict], usage: dict, created: int | None = None
) -> dict:
    """The non-streamed answer with its `choices` (from `choice`) and `usage` (from `usage_of`)."""
    return {
        "id": response_id(kind, request_id),
        "object": "text_completion" if kind == COMPLETIONS else "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def model_list(model: str, max_model_len: int, created: int, adapters: Sequence[str] = ()) -> dict:
    """`GET /v1/models`: OpenAI's list of the model this worker serves (vLLM's `max_model_len`
    added), then each LoRA adapter with the model as its `parent`, as vLLM lists them (`root` is
    the adapter's name: a server path is not the client's business; docs/lora.md)."""
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "orcaserve", "root": name, "parent": parent}
        | {"max_model_len": max_model_len}
        for name, parent in [(model, None), *((a, model) for a in adapters)]
    ]
    return {"object": "list", "data": data}


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
    index: int = 0,
) -> dict:
    """One OpenAI streaming chunk of choice `index`; `usage` set gives the trailing usage-only chunk (no choices):
    (prompt, completion) tokens, or (prompt, completion, cached prompt) tokens."""
    obj = "text_completion" if kind == COMPLETIONS else "chat.completion.chunk"
    chunk: dict = {"id": response_id(kind, request_id), "object": obj, "created": created, "model": model}
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = usage_of(*usage)
        return chunk
    reason = openai_finish_reason(finish_reason)
    if kind == COMPLETIONS:
        one = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    else:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        one = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    chunk["choices"] = [one]
    return chunk


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying a JSON object (or the literal `[DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")

"""Anthropic's Messages answers: the `message` object, its streamed events (message_start,
content_block_start / delta / stop, message_delta, message_stop) and its error shape, made from
one `Answer` (handler/answer.py) (docs/protocols.md, 'Anthropic Messages')."""

from __future__ import annotations

import dataclasses
import json

from orcaserve.handler.answer import Answer, Part
from orcaserve.handler.openai.errors import HttpError

# OpenAI's finish reasons as Anthropic's stop reasons (a stop string: `stop_sequence`).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Error types by HTTP status (Anthropic's `{"type": "error", "error": {"type", "message"}}`).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, openai_body: dict) -> dict:
    """An error in Anthropic's shape, from the OpenAI error object the server builds."""
    message = (openai_body.get("error") or {}).get("message", "")
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(error: HttpError) -> HttpError:
    """A failed request's answer (openai/errors.py `http_error`) in Anthropic's shape: the same
    status and Retry-After."""
    return dataclasses.replace(error, body=error_body(error.status, error.body))


def _tool_use(call: dict) -> dict:
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": fn["name"],
        "input": arguments,
    }


def _usage(answer: Answer | None, prompt_tokens: int = 0) -> dict:
    usage = {
        "input_tokens": answer.prompt_tokens if answer is not None else prompt_tokens,
        "output_tokens": answer.completion_tokens if answer is not None else 0,
    }
    if answer is not None and answer.cached_tokens:
        usage["cache_read_input_tokens"] = answer.cached_tokens
    return usage


def _stop_reason(answer: Answer) -> str:
    """Anthropic's: `tool_use` whenever the answer calls a tool (also a call forced by
    `tool_choice`, whose chat completions finish reason is `stop`)."""
    if answer.tool_calls:
        return "tool_use"
    return "stop_sequence" if answer.stop_sequence is not None else _STOP_REASONS.get(answer.finish_reason, "end_turn")


def _message(request_id: str, model: str, content: list[dict], answer: Answer | None, prompt_tokens: int = 0) -> dict:
    return {
        "id": "msg_" + request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(answer) if answer is not None else None,
        "stop_sequence": answer.stop_sequence if answer is not None else None,
        "usage": _usage(answer, prompt_tokens),
    }


def message(request_id: str, model: str, answer: Answer) -> dict:
    """The non-streamed `message`: thinking, text and tool_use blocks."""
    content: list[dict] = []
    if answer.thinking:
        content.append({"type": "thinking", "thinking": answer.thinking, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    content += [_tool_use(call) for call in answer.tool_calls]
    return _message(request_id, model, content, answer)


def event(name: str, data: dict) -> str:
    """One Server-Sent Event of Anthropic's stream: named, its data carrying the same `type`."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageEvents:
    """An answer's parts as Anthropic's events: one content block per kind in a row (thinking,
    then text), one per tool call."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model
        self._open: str | None = None  # the kind of the block now open
        self._index = -1

    def start(self, prompt_tokens: int) -> str:
        return event("message_start", {"message": _message(self.request_id, self.model, [], None, prompt_tokens)})

    def _block(self, kind: str, block: dict) -> str:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + event("content_block_start", {"index": self._index, "content_block": block})

    def _close(self) -> str:
        if self._open is None:
            return ""
        out = ""
        if self._open == "thinking":
            out = event(
                "content_block_delta", {"index": self._index, "delta": {"type": "signature_delta", "signature": ""}}
            )
        self._open = None
        return out + event("content_block_stop", {"index": self._index})

    def part(self, part: Part) -> str:
        out = ""
        if part.kind == "thinking":
            if self._open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": part.value}
            return out + event("content_block_delta", {"index": self._index, "delta": delta})
        if part.kind == "text":
            if self._open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": part.value}
            return out + event("content_block_delta", {"index": self._index, "delta": delta})
        if part.kind == "tool_call":
            assert part.call is not None
            block = _tool_use(part.call)
            out += self._block("tool_use", {**block, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            return out + event("content_block_delta", {"index": self._index, "delta": delta}) + self._close()
        assert part.answer is not None
        answer = part.answer
        delta = {"stop_reason": _stop_reason(answer), "stop_sequence": answer.stop_sequence}
        usage = {"output_tokens": answer.completion_tokens}
        return (
            out + self._close() + event("message_delta", {"delta": delta, "usage": usage}) + event("message_stop", {})
        )

    def error(self, error: HttpError) -> str:
        """An error after the stream began (its 200 already sent; `error` in Anthropic's shape):
        in-band, as Anthropic's `error` event."""
        return event("error", {"error": error.body["error"]})

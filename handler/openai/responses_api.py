"""OpenAI's Responses API (`POST /v1/responses`), stateless: the request as the chat completions
body it means, and one `Answer` (handler/answer.py) as a `response` object or its streamed
events (docs/protocols.md, 'OpenAI Responses'). Nothing is stored: `previous_response_id` is
refused, `store` is accepted and nothing is kept. (`responses.py` beside this holds the chat
completions' answers, not this API.)"""

from __future__ import annotations

import json
import time
from typing import Any

from orcaserve.handler.answer import Answer, Part
from orcaserve.handler.openai.errors import HttpError
from orcaserve.handler.openai.protocol import ProtocolError

_FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "store",
    "metadata",
    "user",
    "truncation",
    "previous_response_id",
    "reasoning",
    "include",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
}
_IGNORED = {"store", "metadata", "user", "truncation", "reasoning", "include", "service_tier", "safety_identifier"}
_IGNORED |= {"prompt_cache_key"}


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ProtocolError(f"input[{i}].content must be a string or a list of input_text parts", "input")


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ProtocolError("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _content(i, item.get("content"))})
        elif kind == "function_call" and isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str):
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item.get("arguments") or "{}"}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "content": text, "tool_call_id": item["call_id"]})
        elif kind == "reasoning":
            continue  # earlier thinking stays out of the prompt
        else:
            raise ProtocolError(
                f"input[{i}] must be a message, function_call, function_call_output or reasoning item", "input"
            )
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ProtocolError("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ProtocolError(f"tools[{i}]: only function tools are served", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_body(body: dict) -> tuple[dict, tuple[str, ...]]:
    """The chat completions body of a Responses request, and the fields accepted but ignored."""
    for key in body:
        if key not in _FIELDS:
            raise ProtocolError(f"unknown field {key!r}", key)
    if body.get("previous_response_id") is not None:
        raise ProtocolError(
            "previous_response_id is not supported: this server stores no responses (stateless); "
            "send the whole conversation as input items",
            "previous_response_id",
        )
    messages = _messages(body.get("input"))
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ProtocolError("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    out: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "tool_choice"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if isinstance(out.get("tool_choice"), dict) and out["tool_choice"].get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": out["tool_choice"].get("name")}}
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ProtocolError("text.format must be an object", "text")
        if fmt.get("type") == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
            out["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            out["response_format"] = fmt
    return out, tuple(sorted(k for k in body if k in _IGNORED))


def _items(request_id: str, answer: Answer) -> list[dict]:
    items: list[dict] = []
    if answer.thinking:
        text = [{"type": "reasoning_text", "text": answer.thinking}]
        items.append({"type": "reasoning", "id": f"rs_{request_id}", "summary": [], "content": text})
    if answer.text or not answer.tool_calls:
        items.append(_message_item(request_id, answer.text, _status(answer)))
    items += [_call_item(call) for call in answer.tool_calls]
    return items


def _message_item(request_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": f"msg_{request_id}", "status": status, "role": "assistant", "content": content}


def _call_item(call: dict) -> dict:
    fn = call["function"]
    item = {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"]}
    return {**item, "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}


def _status(answer: Answer) -> str:
    return "incomplete" if answer.finish_reason == "length" else "completed"


def _response(request_id: str, model: str, status: str, output: list[dict], answer: Answer | None) -> dict:
    usage = None
    if answer is not None:
        usage = {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": answer.cached_tokens},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "incomplete_details": incomplete,
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": False,
        "previous_response_id": None,
        "usage": usage,
    }


def response(request_id: str, model: str, answer: Answer) -> dict:
    """The non-streamed `response`: reasoning, message and function_call items."""
    return _response(request_id, model, _status(answer), _items(request_id, answer), answer)


class ResponseEvents:
    """An answer's parts as the Responses API's events, each numbered (`sequence_number`)."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model
        self._seq = 0
        self._open: str | None = None  # reasoning | message: the output item now open
        self._text = ""  # the open item's text so far
        self._output: list[dict] = []

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self, prompt_tokens: int) -> str:
        created = _response(self.request_id, self.model, "in_progress", [], None)
        return self._event("response.created", response=created) + self._event("response.in_progress", response=created)

    def _item_id(self, kind: str) -> str:
        return f"rs_{self.request_id}" if kind == "reasoning" else f"msg_{self.request_id}"

    def _begin(self, kind: str) -> str:
        out = self._close()
        self._open, self._text, index = kind, "", len(self._output)
        if kind == "reasoning":
            item: dict = {"type": "reasoning", "id": self._item_id(kind), "summary": [], "content": []}
            part: dict = {"type": "reasoning_text", "text": ""}
        else:
            item = {**_message_item(self.request_id, "", "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out += self._event("response.output_item.added", output_index=index, item=item)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return out + self._event("response.content_part.added", **ids, part=part)

    def _close(self, status: str = "completed") -> str:
        if self._open is None:
            return ""
        kind, text, index = self._open, self._text, len(self._output)
        ids = {"item_id": self._item_id(kind), "output_index": index, "content_index": 0}
        if kind == "reasoning":
            part: dict = {"type": "reasoning_text", "text": text}
            out = self._event("response.reasoning_text.done", **ids, text=text)
            item = {"type": "reasoning", "id": ids["item_id"], "summary": [], "content": [part]}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._event("response.output_text.done", **ids, text=text, logprobs=[])
            item = _message_item(self.request_id, text, status)
        out += self._event("response.content_part.done", **ids, part=part)
        self._output.append(item)
        self._open = None
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def part(self, part: Part) -> str:
        if part.kind in ("thinking", "text"):
            kind = "reasoning" if part.kind == "thinking" else "message"
            out = self._begin(kind) if self._open != kind else ""
            self._text += part.value
            ids = {"item_id": self._item_id(kind), "output_index": len(self._output), "content_index": 0}
            if kind == "reasoning":
                return out + self._event("response.reasoning_text.delta", **ids, delta=part.value)
            return out + self._event("response.output_text.delta", **ids, delta=part.value, logprobs=[])
        if part.kind == "tool_call":
            assert part.call is not None
            item, index = _call_item(part.call), len(self._output)
            out = self._close()
            index = len(self._output)
            out += self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            ids = {"item_id": item["id"], "output_index": index}
            out += self._event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            out += self._event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
            self._output.append(item)
            return out + self._event("response.output_item.done", output_index=index, item=item)
        answer = part.answer
        assert answer is not None
        status = _status(answer)
        out = self._close(status)
        if not self._output:  # an empty answer still has its message
            out += self._begin("message") + self._close(status)
        final = _response(self.request_id, self.model, status, self._output, answer)
        return out + self._event(
            "response.completed" if status == "completed" else "response.incomplete", response=final
        )

    def error(self, error: HttpError) -> str:
        """An error after the stream began: the Responses API's `error` event."""
        body = error.body.get("error") or {}
        return self._event("error", code=body.get("type"), message=body.get("message", ""), param=body.get("param"))

"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): what a request asks for,
the constraint that makes `required` and named calls parse, and the answer's `tool_calls`.

- `none`: tools are rendered, the answer is text.
- `auto`: the template renders the tools (scheduler/serving/tool_template.py) and the model's
  Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks become `tool_calls`
  (finish_reason `tool_calls`); text before them is the content.
- `required`: the answer is constrained to a JSON list of `{"name", "arguments"}` objects, one of
  the tools each with arguments valid against its schema (one call unless parallel_tool_calls).
- a named function: the answer is constrained to that function's arguments (finish_reason
  `stop`, as OpenAI answers a forced call).
docs/serving.md, 'Structured outputs and tool calls'.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from orcaserve.handler.openai.structured import FieldError, structured_outputs
from orcaserve.scheduler.structured_outputs import StructuredOutputs

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# A Hermes-style call; an unclosed one at the very end (the model stopped inside it) counts too.
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict]  # as sent, checked: [{"type": "function", "function": {"name", ...}}]
    choice: str  # none | auto | required | function
    name: str | None = None  # the named function
    parallel: bool = True

    def _parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or _EMPTY_PARAMETERS

    def constraint(self) -> StructuredOutputs | None:
        """The grammar a `required` or named call is held to; None for none/auto."""
        if self.choice == "function":
            assert self.name is not None
            return StructuredOutputs(json=self._parameters(self.name), param="tool_choice")
        if self.choice != "required":
            return None
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"enum": [name]}, "arguments": self._parameters(name)},
                        "required": ["name", "arguments"],
                    }
                    for name in (t["function"]["name"] for t in self.tools)
                ]
            },
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputs(json=calls, param="tools")

    @property
    def parses(self) -> bool:
        """Whether the answer's text becomes tool calls (so a stream holds it back to the end)."""
        return self.choice != "none"

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of an answer; text that does not parse stays
        content (e.g. a call cut off by max_tokens)."""
        if self.choice == "none":
            return text, [], finish_reason
        if self.choice == "function":
            assert self.name is not None
            return (None, [_call(self.name, text)], "stop") if _loads(text) is not None else (text, [], finish_reason)
        if self.choice == "required":
            found = _loads(text)
            calls = [_call(c["name"], c["arguments"]) for c in found] if isinstance(found, list) else []
            return (None, calls, "tool_calls") if calls else (text, [], finish_reason)
        return self._parse_auto(text, finish_reason)

    def _parse_auto(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
        names = {t["function"]["name"] for t in self.tools}
        calls = []
        for block in _TOOL_CALL.finditer(text):
            found = _loads(block.group(1))
            if isinstance(found, dict) and found.get("name") in names:
                args = found.get("arguments", found.get("parameters", {}))
                calls.append(_call(found["name"], args))
        if not calls:
            return text, [], finish_reason
        content = text[: text.index("<tool_call>")].strip() or None
        return content, calls if self.parallel else calls[:1], "tool_calls"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name: str, arguments: Any) -> dict:
    """One of OpenAI's `tool_calls`: arguments as JSON text, an id of OpenAI's shape."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def request_constraints(body: dict) -> tuple[StructuredOutputs | None, ToolSpec | None]:
    """The constraint (structured outputs, or a required / named call) and the tool set a chat
    request asks for; raises FieldError naming a malformed field."""
    spec = _tool_spec(body)
    constraint = structured_outputs(body)
    forced = spec.constraint() if spec is not None else None
    if constraint is not None and forced is not None:
        raise FieldError(f"tool_choice {spec.choice!r} cannot be combined with {constraint.param}", "tool_choice")  # type: ignore[union-attr]
    return constraint or forced, spec


def _tool_spec(body: dict) -> ToolSpec | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise FieldError(f"tools must be a list of 1 to {MAX_TOOLS} function tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise FieldError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise FieldError("tools must have distinct names", "tools")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise FieldError(f"tool_choice must name one of the tools {names}, got {choice!r}", "tool_choice")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise FieldError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
    return ToolSpec(tools, choice, name, parallel is not False)


def tool_message(i: int, message: dict) -> dict:
    """A `tool` result or an assistant turn with `tool_calls`, as the chat template takes them
    (arguments as objects, as transformers' templates expect)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if message.get("role") == "tool":
        if not isinstance(content, str) or not isinstance(message.get("tool_call_id", ""), str):
            raise FieldError(f"messages[{i}]: a tool message needs content and a tool_call_id", "messages")
        return {"role": "tool", "content": content, "tool_call_id": message.get("tool_call_id", "")}
    calls = message.get("tool_calls")
    bad_content = content is not None and not isinstance(content, str)
    if message.get("role") != "assistant" or not isinstance(calls, list) or bad_content:
        raise FieldError(f"messages[{i}]: tool_calls belong to an assistant message", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(f"messages[{i}].tool_calls must be function calls with a name", "messages")
        args = fn.get("arguments", "{}")
        parsed = _loads(args) if isinstance(args, str) else args
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": parsed}})
    return {"role": "assistant", "content": content or "", "tool_calls": out}


def shape_choice(choice: dict, spec: ToolSpec | None) -> dict:
    """A non-streamed chat choice with its text parsed into `tool_calls` where the request asks."""
    if spec is None or not spec.parses:
        return choice
    message = choice["message"]
    content, calls, reason = spec.parse(message["content"], choice["finish_reason"])
    message["content"] = content
    if calls:
        message["tool_calls"] = calls
    choice["finish_reason"] = reason
    return choice


def stream_tail(spec: ToolSpec, text: str, chunk: dict) -> list[dict]:
    """The chunks that end a streamed choice whose text was held back: its content, its calls
    as OpenAI's deltas (one per call, whole), then `chunk` (the finish chunk) with the reason."""
    one = chunk["choices"][0]
    content, calls, reason = spec.parse(text, one["finish_reason"])
    out = []
    if content:
        out.append({**chunk, "choices": [{**one, "delta": {"content": content}, "finish_reason": None}]})
    for k, call in enumerate(calls):
        delta = {"tool_calls": [{"index": k, **call}]}
        out.append({**chunk, "choices": [{**one, "delta": delta, "finish_reason": None}]})
    out.append({**chunk, "choices": [{**one, "finish_reason": reason}]})
    return out

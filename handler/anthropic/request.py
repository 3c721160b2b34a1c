"""Anthropic's Messages request (`POST /v1/messages`) as the chat completions body it means: the
translation at the edge, after which the request is parsed, checked and served as any chat
request (openai/protocol.py) (docs/protocols.md, 'Anthropic Messages').

- `system` (a string or text blocks) becomes the first system message; `messages` content blocks
  `text`, `tool_use` (an assistant's calls), `tool_result` (the user's results: tool messages)
  and `thinking` (earlier thinking: dropped, as Anthropic's own API drops it from the prompt);
- `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`;
- `tools` (`name`, `description`, `input_schema`) and `tool_choice` auto / any / tool / none
  (`disable_parallel_tool_use`) as function tools, `auto` / `required` / a named function;
- `thinking` `{"type": "enabled" | "disabled" | "adaptive"}` as the template's `enable_thinking`
  (true, false, the template's default); its `budget_tokens` and `display` are not acted on;
- `output_config.format` (`json_schema`) as a JSON-schema response format (structured outputs);
- fields that change nothing about the tokens (`metadata`, `service_tier`, `cache_control`, ...:
  `_IGNORED`) accepted and ignored; anything else is refused.
"""

from __future__ import annotations

import json
from typing import Any

from orcaserve.handler.openai.protocol import ProtocolError

_FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
}
# Fields of Anthropic's API that change nothing about the tokens a request gets back here:
# accepted, ignored, named in the answer's ignored-fields header. `cache_control`: prompt prefixes
# are cached without being asked (docs/kv-cache.md, "Prefix caching").
_IGNORED = {
    "metadata",
    "service_tier",
    "cache_control",
    "speed",
    "inference_geo",
    "diagnostics",
    "container",
    "user_profile_id",
    "workspace_id",
}
_FIELDS |= _IGNORED
# `thinking.type` -> the template's `enable_thinking` (None: the template's default).
_THINKING = {"enabled": True, "disabled": False, "adaptive": None}


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in blocks
    ):
        return "".join(b["text"] for b in blocks)
    raise ProtocolError(f"{where} must be a string or a list of text blocks", where.split("[")[0].split(".")[0])


def _turns(i: int, message: Any) -> list[dict]:
    """One Anthropic message as chat messages (a user turn with tool results becomes tool messages,
    then the user's text, if any)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise ProtocolError(f"messages[{i}] must be an object with role user or assistant", "messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ProtocolError(f"messages[{i}].content must be a string or a list of blocks", "messages")
    texts, calls, results = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            result = _text_of(block.get("content", ""), f"messages[{i}].content tool_result content")
            if block.get("is_error"):
                result = f"Error: {result}"
            results.append({"role": "tool", "content": result, "tool_call_id": block["tool_use_id"]})
        else:
            raise ProtocolError(
                f"messages[{i}].content: a {role} message takes text"
                + (", thinking and tool_use" if role == "assistant" else " and tool_result")
                + f" blocks, got {str(kind or block)[:64]!r}",
                "messages",
            )
    if calls:
        return [{"role": "assistant", "content": "".join(texts), "tool_calls": calls}]
    return results + ([{"role": role, "content": "".join(texts)}] if texts or not results else [])


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ProtocolError("tools must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or tool.get("type") not in (None, "custom")
        ):
            raise ProtocolError(f"tools[{i}] must be a custom tool with a name and an input_schema", "tools")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's `tool_choice`."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = None
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is not None:
        parallel = not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ProtocolError(f"tool_choice must be auto, any, tool (with a name) or none, got {choice!r}", "tool_choice")


def chat_body(body: dict, count_only: bool = False) -> tuple[dict, tuple[str, ...]]:
    """The chat completions body of a Messages request, and the fields accepted but ignored.
    `count_only` (count_tokens): only what shapes the prompt; `max_tokens` not required."""
    for key in body:
        if key not in _FIELDS:
            raise ProtocolError(f"unknown field {key!r}", key)
    if not count_only and body.get("max_tokens") is None:
        raise ProtocolError("max_tokens is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", "messages")
    chat: list[dict] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(messages):
        chat += _turns(i, message)
    out: dict[str, Any] = {"messages": chat}
    for name in ("model", "temperature", "top_p", "top_k", "stream") + (() if count_only else ("max_tokens",)):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences") is not None and not count_only:
        out["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
            if parallel is not None:
                out["parallel_tool_calls"] = parallel
    elif body.get("tool_choice") is not None:
        raise ProtocolError("tool_choice needs tools", "tool_choice")
    ignored = {k for k in body if k in _IGNORED}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in _THINKING:
            raise ProtocolError(f"thinking.type must be one of {sorted(_THINKING)}, got {thinking!r}", "thinking")
        if _THINKING[kind] is not None:
            out["chat_template_kwargs"] = {"enable_thinking": _THINKING[kind]}
        ignored |= {f"thinking.{k}" for k in thinking if k != "type"}
    ignored |= _output_config(body.get("output_config"), out)
    return out, tuple(sorted(ignored))


def _output_config(config: Any, out: dict) -> set[str]:
    """`output_config`: its `format` (a JSON schema) as chat completions' `response_format`, put in
    `out`; returns the parts not acted on (`effort`)."""
    if config is None:
        return set()
    if not isinstance(config, dict) or not set(config) <= {"format", "effort"}:
        raise ProtocolError("output_config must be an object with format and effort", "output_config")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ProtocolError(
                "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config"
            )
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return {"output_config.effort"} if config.get("effort") is not None else set()

"""A conversation's tool turns as OpenAI clients send them back: the assistant's call, then the result."""

from __future__ import annotations


def tool_turns(name: str, arguments: str, result: str, call_id: str = "call_1") -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]

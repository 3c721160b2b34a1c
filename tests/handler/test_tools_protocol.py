"""Structured outputs and tool calls in the OpenAI layer: what requests ask for, how
Hermes-style tool calls are parsed from crafted text, and the answers' shapes."""

from __future__ import annotations

import json

import pytest
from tool_turns import tool_turns

from orcaserve.handler.openai import protocol as P
from orcaserve.handler.openai.tools import ToolSpec, shape_choice, stream_tail
from orcaserve.scheduler.prompt import ChatPrompt, encode_prompt

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**extra) -> P.ParsedRequest:
    return P.parse_request({"messages": USER, **extra}, P.CHAT)


def test_response_format_and_vllm_extras_become_constraints():
    assert chat().params.structured_outputs is None
    assert chat(response_format={"type": "text"}).params.structured_outputs is None
    assert chat(response_format={"type": "json_object"}).params.structured_outputs.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    spec = chat(response_format=fmt).params.structured_outputs
    assert json.loads(spec.json) == schema and spec.strict and spec.param == "response_format"
    assert not chat(
        response_format={**fmt, "json_schema": {"name": "x", "schema": schema}}
    ).params.structured_outputs.strict
    assert chat(guided_regex="[0-9]+").params.structured_outputs.regex == "[0-9]+"
    assert chat(guided_choice=["a", "b"]).params.structured_outputs.choice == ("a", "b")
    assert json.loads(chat(guided_json=schema).params.structured_outputs.json) == schema
    spec = P.parse_request(
        {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}, P.COMPLETIONS
    ).params.structured_outputs
    assert spec.choice == ("yes", "no") and spec.param == "structured_outputs"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(extra, param):
    with pytest.raises(P.ProtocolError) as e:
        chat(**extra)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_choices_and_their_constraints():
    auto = chat(tools=[WEATHER, TIME])
    assert auto.tool_spec.choice == "auto" and auto.params.structured_outputs is None
    assert auto.prompt.tools == [WEATHER, TIME]
    assert chat(tools=[WEATHER], tool_choice="none").params.structured_outputs is None
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.params.structured_outputs.json) == WEATHER["function"]["parameters"]
    req = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.params.structured_outputs.json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert "maxItems" not in json.loads(chat(tools=[WEATHER], tool_choice="required").params.structured_outputs.json)


def test_tool_turns_go_back_through_the_template(tokenizer):
    messages = USER + tool_turns("get_weather", '{"city": "Paris"}', "22 C, sunny")
    req = chat(messages=messages, tools=[WEATHER])
    assert req.prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = tokenizer.decode(encode_prompt(tokenizer, req.prompt, 49152, 8192))
    assert '"name": "get_weather"' in text and "<tools>" in text  # SmolLM2's template gets the Hermes one
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.decode(encode_prompt(tokenizer, ChatPrompt(USER), 49152, 8192))
    assert "<tools>" not in plain and "SmolLM" in plain  # without tools: the model's own template
    with pytest.raises(P.ProtocolError):
        chat(messages=USER + [{"role": "tool", "content": 5}])


AUTO = ToolSpec([WEATHER, TIME], "auto")


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("It is sunny.", "It is sunny.", []),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # stopped before the tag
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            [],
        ),
    ],
)
def test_auto_parses_hermes_tool_calls(text, content, calls):
    got_content, got_calls, reason = AUTO.parse(text, "stop")
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert reason == ("tool_calls" if calls else "stop")
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


def test_parallel_false_keeps_the_first_call_and_forced_calls_parse():
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    assert len(ToolSpec([TIME], "auto", parallel=False).parse(two, "stop")[1]) == 1
    content, calls, reason = ToolSpec([WEATHER], "function", "get_weather").parse('{"city": "Rome"}', "stop")
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Rome"}' and reason == "stop"
    content, calls, reason = ToolSpec([WEATHER], "function", "get_weather").parse('{"city": "Ro', "length")
    assert content == '{"city": "Ro' and calls == [] and reason == "length"  # cut off: left as text
    required = ToolSpec([WEATHER, TIME], "required")
    content, calls, reason = required.parse('[{"name": "get_time", "arguments": {}}]', "stop")
    assert content is None and calls[0]["function"]["name"] == "get_time" and reason == "tool_calls"


def test_answer_shapes():
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "stop"}
    shaped = shape_choice(choice, AUTO)
    assert shaped["message"]["content"] == "Sure." and shaped["finish_reason"] == "tool_calls"
    assert shaped["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    end = {"id": "c", "choices": [{"index": 2, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    tail = stream_tail(AUTO, text, end)
    assert [c["choices"][0]["delta"] for c in tail[:1]] == [{"content": "Sure."}]
    call = tail[1]["choices"][0]["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "get_time" and call["type"] == "function"
    assert tail[-1]["choices"][0]["finish_reason"] == "tool_calls" and all(c["choices"][0]["index"] == 2 for c in tail)

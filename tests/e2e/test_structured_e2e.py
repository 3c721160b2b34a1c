"""End to end through the real `openai` client over a real TorchServe: structured
outputs (`response_format` json_object and json_schema strict, vLLM's extras) and tool calls
(`tool_choice` required, named, auto, none; tool results back through the template), streamed and
not; an invalid schema is a 400 naming the problem.

SmolLM2-135M-Instruct serves; its template knows no tools, so the Hermes-style one renders them
(scheduler/serving/tool_template.py). What `auto` makes of them is up to the model: only the
answer's shape is asserted (the parser is tested on crafted text in test_tools_protocol.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai_http import SHARED_MODEL
from tool_turns import tool_turns

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

# The suites' shared server (conftest.py), in the dense exact configuration: the answers' shapes
# asserted below are the dense fp32 model's.
MODEL = SHARED_MODEL
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer with a tool call."}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(shared_ts):
    return openai.OpenAI(base_url=shared_ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=shared_ts.keys["inference"])


def _create(client, stream: bool, **kwargs):
    """A chat answer as (content, tool calls as (name, arguments text), finish_reason), streamed
    (deltas assembled as a client does) or not."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
            reason = c.finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_and_json_object(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Describe a fictional person as JSON."}]
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        content, calls, reason = _create(
            client, stream, messages=ask, response_format=fmt, max_tokens=300, temperature=temperature, seed=seed
        )
        assert reason == "stop" and not calls, content
        jsonschema.validate(json.loads(content), PERSON)
    content, _, reason = _create(
        client, stream, messages=ask, response_format={"type": "json_object"}, max_tokens=300, temperature=0
    )
    assert reason == "stop" and isinstance(json.loads(content), dict), content


def test_vllm_extras(client):
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert answer.choices[0].message.content in ("yes", "no")
    answer = client.completions.create(
        model=MODEL, prompt="A date:", max_tokens=20, extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", answer.choices[0].text), answer.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_parse_and_validate(client, stream):
    for temperature in (0, 1.0):
        content, calls, reason = _create(
            client, stream, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200,
            temperature=temperature, seed=3,
        )  # fmt: skip
        assert reason == "tool_calls" and calls and content is None, (content, calls)
        for name, args in calls:
            jsonschema.validate(json.loads(args), PARAMETERS[name])
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, reason = _create(
        client, stream, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=200, temperature=0
    )
    assert reason == "stop" and [name for name, _ in calls] == ["get_time"] and content is None
    jsonschema.validate(json.loads(calls[0][1]), PARAMETERS["get_time"])
    _, calls, _ = _create(
        client, stream, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=0,
    )  # fmt: skip
    assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_and_none_answer_in_shape_and_tool_results_go_back(client, stream):
    content, calls, reason = _create(client, stream, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    assert reason in ("stop", "length", "tool_calls") and (content is not None or calls)
    assert all(name in PARAMETERS for name, _ in calls) and (reason == "tool_calls") == bool(calls)
    content, calls, reason = _create(
        client, stream, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0
    )
    assert isinstance(content, str) and not calls and reason in ("stop", "length")
    history = ASK + tool_turns("get_weather", '{"city": "Paris", "unit": "celsius"}', "22 degrees, sunny")
    content, calls, reason = _create(client, stream, messages=history, tools=[WEATHER], max_tokens=30, temperature=0)
    assert reason in ("stop", "length", "tool_calls") and (content or calls)


def test_an_invalid_schema_is_a_400_naming_the_problem(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad, max_tokens=5)
    assert e.value.status_code == 400 and "objectx" in str(e.value) and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:  # refused at parsing: the tool's shape
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function"}], max_tokens=5)
    assert e.value.body["param"] == "tools"
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)
    assert answer.choices[0].message.content  # the server goes on

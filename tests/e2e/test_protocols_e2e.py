"""End to end through the real `anthropic` and `openai` clients over a real TorchServe: Messages
(create, stream, count_tokens, tools, errors) and Responses (create, stream, tools, errors),
greedy answers held to chat completions' own for the same conversation (one engine path)."""

from __future__ import annotations

import pytest
import requests

from orcaserve.bench.serve.harness import serving

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "smollm2"
ENGINE_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 512, "dtype": "float32"}
QUESTION = "Name a primary color."
WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("torchserve"), MODEL, ENGINE_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def claude(ts):
    # TorchServe checks `Authorization: Bearer` before the handler: the key goes as auth_token.
    return anthropic.Anthropic(base_url=ts.url(f"/predictions/{MODEL}/1.0"), auth_token=ts.keys["inference"])


@pytest.fixture(scope="module")
def gpt(ts):
    return openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])


def chat_answer(gpt, max_tokens: int, **extra) -> str:
    messages = [{"role": "user", "content": QUESTION}]
    out = gpt.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    return out.choices[0].message.content


def test_messages_create_stream_and_count(claude, gpt):
    want = chat_answer(gpt, 8)
    messages = [{"role": "user", "content": QUESTION}]
    msg = claude.messages.create(model=MODEL, max_tokens=8, messages=messages, temperature=0)
    assert msg.content[0].type == "text" and msg.content[0].text == want
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 8
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages, temperature=0) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == msg.stop_reason
    count = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == msg.usage.input_tokens
    system = claude.messages.create(
        model=MODEL, max_tokens=4, system="Answer in French.", messages=messages, temperature=0, top_k=1
    )
    assert system.usage.input_tokens > msg.usage.input_tokens


def test_messages_tools_and_errors(claude, ts):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    forced = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        temperature=0,
    )
    call = next(b for b in forced.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    follow = [
        *messages,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    after = claude.messages.create(model=MODEL, max_tokens=6, messages=follow, tools=[WEATHER], temperature=0)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[], temperature=0)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    # x-api-key alone: TorchServe's frontend refuses it before the handler sees the request.
    raw = requests.post(
        ts.url(f"/predictions/{MODEL}/1.0/v1/messages"),
        headers={"x-api-key": ts.keys["inference"], "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "max_tokens": 2, "messages": messages},
        timeout=60,
    )
    assert raw.status_code == 400 and "InvalidKeyException" in raw.text


def test_responses_create_stream_tools_and_errors(gpt):
    want = chat_answer(gpt, 8)
    out = gpt.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0, store=False)
    assert out.output_text == want and out.usage.output_tokens <= 8
    deltas, final = [], None
    with gpt.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == want and final.output_text == want
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    called = gpt.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}}
    shaped = gpt.responses.create(model=MODEL, input=QUESTION, text=fmt, max_output_tokens=40, temperature=0)
    assert shaped.output_text.startswith("{")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        gpt.responses.create(model=MODEL, input="x", previous_response_id="resp_1")

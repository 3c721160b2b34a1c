"""End to end through the real `anthropic` and `openai` clients over a real TorchServe: Messages
(create, stream, count_tokens, tools, errors) and Responses (create, stream, tools, structured
output, errors) with the default model, greedy answers held to chat completions' own for the same
conversation (one engine path); and a tiny model whose chat template has think tags (its
reasoning parser chosen from the template), its thinking kept apart from its answer in all three
protocols, streamed and not."""

from __future__ import annotations

import pytest
import requests
from openai_http import EXACT, SHARED_MODEL
from thinking_models import ANSWER, ANSWER_THINKING, QWEN3_TEMPLATE, cut, served

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

# The default model on the suites' shared server (conftest.py) and a thinker registered beside it,
# both in the dense exact configuration (openai_http.EXACT): the protocols are proven, not the
# default's arithmetic.
MODEL, THINKER = SHARED_MODEL, "thinker"
THINKER_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 512, **EXACT}
QUESTION = "Name a primary color."
THINKER_QUESTION = "Is 2 < 3?"  # the prompt the thinker's chain starts from (thinking_models.served)
GREEDY = {"temperature": 0}  # the `anthropic` client sends sampling fields as extra body fields
WEATHER = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def ts(shared_ts, registered_archive, tmp_path_factory, tokenizer):
    """The suites' shared server (conftest.py) with the thinker registered beside its model."""
    root = tmp_path_factory.mktemp("thinker")
    tok, model = served(tokenizer, QWEN3_TEMPLATE, cut(3, 5, False))  # `<thi|nk>`, `</thi|nk>`: split tags
    model.save_pretrained(root / "thinker-model")
    tok.save_pretrained(root / "thinker-model")
    registered_archive(THINKER, str(root / "thinker-model"), THINKER_ARGS)  # reasoning_parser: auto
    return shared_ts


def claude_for(ts, model: str):
    # TorchServe checks `Authorization: Bearer` before the handler: the key goes as auth_token.
    return anthropic.Anthropic(base_url=ts.url(f"/predictions/{model}/1.0"), auth_token=ts.keys["inference"])


def gpt_for(ts, model: str):
    return openai.OpenAI(base_url=ts.url(f"/predictions/{model}/1.0/v1"), api_key=ts.keys["inference"])


@pytest.fixture(scope="module")
def claude(ts):
    return claude_for(ts, MODEL)


@pytest.fixture(scope="module")
def gpt(ts):
    return gpt_for(ts, MODEL)


def chat_answer(gpt, max_tokens: int, **extra) -> str:
    messages = [{"role": "user", "content": QUESTION}]
    out = gpt.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    return out.choices[0].message.content


def test_messages_create_stream_and_count(claude, gpt):
    want = chat_answer(gpt, 8)
    messages = [{"role": "user", "content": QUESTION}]
    msg = claude.messages.create(model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY)
    assert msg.content[0].type == "text" and msg.content[0].text == want
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 8
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == msg.stop_reason
    count = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == msg.usage.input_tokens
    system = claude.messages.create(
        model=MODEL, max_tokens=4, system="Answer in French.", messages=messages, extra_body=GREEDY | {"top_k": 1}
    )
    counted = claude.messages.count_tokens(model=MODEL, system="Answer in French.", messages=messages)
    assert counted.input_tokens == system.usage.input_tokens != msg.usage.input_tokens  # the system prompt counts
    stopped = claude.messages.create(
        model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY, stop_sequences=[want[2:4]]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == want[2:4]
    assert stopped.content[0].text == want[: want.index(want[2:4])]


def test_messages_tools_and_errors(claude, ts):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    forced = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    call = next(b for b in forced.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    assert forced.stop_reason == "tool_use"
    follow = [
        *messages,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    after = claude.messages.create(model=MODEL, max_tokens=6, messages=follow, tools=[WEATHER], extra_body=GREEDY)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    shaped = claude.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=messages,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert shaped.content[0].text.startswith('{"city"')
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[], extra_body=GREEDY)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:  # refused before the stream opens: a real 400
        with claude.messages.stream(
            model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": -1}
        ) as stream:
            list(stream)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in str(e.value)
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
            elif event.type in ("response.completed", "response.incomplete"):  # cut: incomplete, as OpenAI's
                final = event.response
    assert "".join(deltas) == want and final.output_text == want and final.status == out.status
    instructed = gpt.responses.create(
        model=MODEL, instructions="Answer in French.", input=QUESTION, max_output_tokens=4, temperature=0
    )
    assert instructed.usage.input_tokens != out.usage.input_tokens  # SmolLM2's template: its own default system
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
    with pytest.raises(openai.BadRequestError) as e:
        with gpt.responses.stream(model=MODEL, input=QUESTION, temperature=-1) as stream:
            list(stream)
    assert e.value.body["param"] == "temperature"


def test_thinking_apart_in_every_protocol(ts):
    claude, gpt = claude_for(ts, THINKER), gpt_for(ts, THINKER)
    user = [{"role": "user", "content": THINKER_QUESTION}]
    chat = gpt.chat.completions.create(model=THINKER, messages=user, temperature=0)
    message = chat.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == ANSWER_THINKING
    pieces = list(gpt.chat.completions.create(model=THINKER, messages=user, temperature=0, stream=True))
    deltas = [p.choices[0].delta for p in pieces if p.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == ANSWER_THINKING

    msg = claude.messages.create(model=THINKER, max_tokens=50, messages=user, extra_body=GREEDY)
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "end_turn"
    assert msg.content[0].thinking == ANSWER_THINKING and msg.content[1].text == ANSWER
    thinking, text = [], []
    with claude.messages.stream(model=THINKER, max_tokens=50, messages=user, extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking.append(event.delta.thinking)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
        final = stream.get_final_message()
    assert ("".join(thinking), "".join(text)) == (ANSWER_THINKING, ANSWER)
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    cut_short = claude.messages.create(model=THINKER, max_tokens=2, messages=user, extra_body=GREEDY)
    assert cut_short.stop_reason == "max_tokens" and [b.type for b in cut_short.content] == ["thinking"]

    out = gpt.responses.create(model=THINKER, input=THINKER_QUESTION, temperature=0)
    assert [item.type for item in out.output] == ["reasoning", "message"] and out.output_text == ANSWER
    assert out.output[0].content[0].text == ANSWER_THINKING
    assert out.usage.output_tokens_details.reasoning_tokens == 4  # the tokens through `</think>`
    reasoning, text = [], []
    with gpt.responses.stream(model=THINKER, input=THINKER_QUESTION, temperature=0) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                reasoning.append(event.delta)
            elif event.type == "response.output_text.delta":
                text.append(event.delta)
        final_response = stream.get_final_response()
    assert ("".join(reasoning), "".join(text)) == (ANSWER_THINKING, ANSWER)
    assert final_response.output_text == ANSWER

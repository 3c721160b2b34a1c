"""The protocol table (handler/protocols.py) and Anthropic's Messages and OpenAI's Responses in it:
requests translated into the chat completions body they mean and parsed as one EngineRequest,
answers and events shaped from one Answer, errors in each protocol's shape."""

from __future__ import annotations

import json

import pytest

from orcaserve.handler.answer import Answer, Part, stop_sequence_of
from orcaserve.handler.anthropic import messages as M
from orcaserve.handler.anthropic.request import chat_body as anthropic_body
from orcaserve.handler.openai import errors as E
from orcaserve.handler.openai import protocol as P
from orcaserve.handler.openai import responses_api as R
from orcaserve.handler.openai.errors import HttpError, http_error
from orcaserve.handler.protocols import (
    COUNT_TOKENS,
    MESSAGES,
    OPENAI_CHAT,
    OPENAI_COMPLETIONS,
    OPENAI_MODELS,
    RESPONSES,
    endpoint_for,
)
from orcaserve.scheduler.errors import Overloaded


class Limits:
    default_timeout = 30.0
    default_max_tokens = None
    max_tokens_limit = 100


WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}


def events(sse: str) -> list[tuple[str, dict]]:
    out = []
    for block in sse.strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_routes():
    assert endpoint_for("/v1/messages") is endpoint_for("messages") is MESSAGES
    assert endpoint_for("v1/messages/count_tokens") is COUNT_TOKENS and endpoint_for("v1/responses/") is RESPONSES
    assert endpoint_for("v1/chat/completions") is endpoint_for("chat/completions") is OPENAI_CHAT
    assert endpoint_for(None) is endpoint_for("/v1/completions") is OPENAI_COMPLETIONS
    assert endpoint_for("models") is OPENAI_MODELS
    with pytest.raises(P.ProtocolError) as e:
        endpoint_for("v1/embeddings")
    assert e.value.status == 404 and "v1/messages" in e.value.message and "v1/responses" in e.value.message


def test_one_engine_request_each_and_errors_in_each_shape():
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "metadata": {}}
    req = MESSAGES.parse(body, "r7", Limits, None)
    assert req.request.request_id == "r7" and req.params.max_tokens == 3 and req.ignored == ("metadata",)
    assert req.request.timeout == 30.0 and req.kind == P.CHAT
    responses = RESPONSES.parse({"input": "x", "max_output_tokens": 4, "store": False}, "r8", Limits, None)
    assert responses.request.request_id == "r8" and responses.params.max_tokens == 4
    with pytest.raises(P.ProtocolError) as e:
        MESSAGES.parse({**body, "max_tokens": 101}, "r9", Limits, None)  # the server's limits hold
    refused = MESSAGES.error(http_error(e.value))
    assert refused.status == 400 and refused.body["type"] == "error"
    assert refused.body["error"]["type"] == "invalid_request_error"
    busy = MESSAGES.error(http_error(Overloaded("full", retry_after=3)))
    assert (busy.status, busy.retry_after, busy.body["error"]["type"]) == (503, 3, "overloaded_error")
    assert RESPONSES.error(http_error(e.value)).body == http_error(e.value).body  # OpenAI's own shape
    assert OPENAI_CHAT.error(busy) is busy


def test_anthropic_request_becomes_a_chat_body():
    body = {
        "model": "m",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "stop_sequences": ["\n\n"],
        "temperature": 0.5,
        "top_k": 3,
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "metadata": {"user_id": "u"},
    }
    chat, ignored = anthropic_body(body)
    assert ignored == ("metadata",)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    req = P.parse_request(chat, P.CHAT)  # the chat request it means, as any other
    assert req.params.max_tokens == 7 and req.params.top_k == 3 and req.params.stop == ["\n\n"]
    assert req.tool_spec.choice == "required" and not req.tool_spec.parallel
    named, _ = anthropic_body({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    counted, _ = anthropic_body({"messages": [{"role": "user", "content": "x"}]}, count_only=True)
    assert "max_tokens" not in counted


@pytest.mark.parametrize(
    "change, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"top_q": 1}, "top_q"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({"tool_choice": {"type": "auto"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"system": 3}, "system"),
    ],
)
def test_anthropic_refusals_name_the_field(change, param):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(P.ProtocolError) as e:
        anthropic_body(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    shaped = M.anthropic_error(http_error(e.value))
    assert shaped.body == {"type": "error", "error": {"type": "invalid_request_error", "message": e.value.message}}
    assert M.error_body(503, e.value.body())["error"]["type"] == "overloaded_error"


def test_anthropic_message_and_events():
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    answer = Answer("hm", "Sure.", [call], "tool_calls", 9, 4, 0)
    msg = M.message("r1", "m", answer)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][2] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "P"}}
    assert msg["stop_reason"] == "tool_use" and msg["usage"] == {"input_tokens": 9, "output_tokens": 4}
    stop = Answer(None, "x", [], "stop", 1, 1, 0, stop_sequence="END")
    assert M.message("r", "m", stop)["stop_reason"] == "stop_sequence"
    assert M.message("r", "m", Answer(None, "x", [], "length", 1, 1))["stop_reason"] == "max_tokens"
    forced = Answer(None, "", [call], "stop", 1, 1)  # a call forced by tool_choice: chat's finish reason is stop
    assert M.message("r", "m", forced)["stop_reason"] == "tool_use"
    writer = M.MessageEvents("r1", "m")
    parts = [Part("thinking", "h"), Part("thinking", "m"), Part("text", "Su"), Part("text", "re.")]
    sse = writer.start(9) + "".join(
        writer.part(p) for p in [*parts, Part("tool_call", call=call), Part("end", answer=answer)]
    )
    seen = events(sse)
    assert [name for name, _ in seen] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",  # the thinking block's signature
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in seen)
    assert [d["index"] for n, d in seen if n == "content_block_start"] == [0, 1, 2]
    assert seen[-2][1]["delta"]["stop_reason"] == "tool_use" and seen[-2][1]["usage"] == {"output_tokens": 4}
    assert json.loads(seen[11][1]["delta"]["partial_json"]) == {"city": "P"}
    failed = events(writer.error(M.anthropic_error(HttpError(503, E.error_body("busy")))))
    assert failed == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]


def test_responses_request_becomes_a_chat_body():
    chat, ignored = R.chat_body({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5, "store": False})
    assert chat == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 5,
    } and ignored == ("store",)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat, _ = R.chat_body(
        {
            "input": items,
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
    }
    assert chat["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema, "strict": True},
    }
    with pytest.raises(P.ProtocolError) as e:
        R.chat_body({"input": "x", "previous_response_id": "resp_1"})
    assert e.value.param == "previous_response_id" and "stores no responses" in e.value.message
    for bad, param in (({"input": []}, "input"), ({"input": "x", "tools": [{"type": "web_search"}]}, "tools")):
        with pytest.raises(P.ProtocolError) as e:
            R.chat_body(bad)
        assert e.value.param == param


def test_responses_object_and_events():
    call = {"id": "call_abc", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    answer = Answer("hm", "Hi.", [call], "tool_calls", 3, 2, 1)
    obj = R.response("r1", "m", answer)
    assert [i["type"] for i in obj["output"]] == ["reasoning", "message", "function_call"]
    assert obj["status"] == "completed" and obj["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    assert obj["output"][2]["call_id"] == "call_abc" and obj["output"][1]["content"][0]["text"] == "Hi."
    cut = R.response("r", "m", Answer(None, "H", [], "length", 1, 1))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    writer = R.ResponseEvents("r1", "m")
    parts = [Part("thinking", "hm"), Part("text", "H"), Part("text", "i."), Part("tool_call", call=call)]
    seen = events(writer.start(3) + "".join(writer.part(p) for p in [*parts, Part("end", answer=answer)]))
    names = [name for name, _ in seen]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in seen] == list(range(len(seen)))
    assert "".join(d["delta"] for n, d in seen if n == "response.output_text.delta") == "Hi."
    assert "".join(d["delta"] for n, d in seen if n == "response.reasoning_text.delta") == "hm"
    assert [d["item"]["type"] for n, d in seen if n == "response.output_item.done"] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert seen[-1][1]["response"]["output"] == obj["output"]
    ((name, failed),) = events(writer.error(HttpError(400, E.error_body("bad", "input"))))
    assert name == "error" and failed["sequence_number"] == len(seen) and failed["param"] == "input"


def test_stop_sequence_of():
    assert stop_sequence_of(["END", "\n"], "abc\nEND", "abc") == "\n"
    assert stop_sequence_of(["END"], "abc<|im_end|>", "abc") is None

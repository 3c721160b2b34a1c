"""Reasoning through the handler and a real engine: a tiny model made to say a chosen answer token
by token, its think tags split across tokens at every position, in chat completions streamed and
not (`reasoning_content` apart from `content`), with tool calls parsed from the answer alone and
a length cut inside the thinking."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_orca_handler import Backend, body_of
from thinking_models import ANSWER, ANSWER_THINKING, QWEN3_TEMPLATE, R1_TEMPLATE, cut, served


def sse_deltas(frames) -> list[dict]:
    events = body_of(frames).decode().split("\n\n")
    chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
    return [c["choices"][0] for c in chunks if c["choices"]]


def ask(backend: Backend, **extra) -> tuple[dict, list[dict]]:
    """The non-streamed message and the streamed deltas of the same greedy request."""
    body = {"messages": [{"role": "user", "content": "Is 2 < 3?"}], "temperature": 0, **extra}

    async def run():
        await asyncio.gather(
            backend.request("whole", body, "v1/chat/completions"),
            backend.request("sse", {**body, "stream": True}, "v1/chat/completions"),
        )

    asyncio.run(run())
    frames = backend.frames()
    return json.loads(body_of(frames["whole"]))["choices"][0], sse_deltas(frames["sse"])


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Every split of the tags is the splitter's (tests/handler/test_reasoning.py, fast); served, four
# keep the path through the handler fast (both tags cut inside, one each way; `</think>` whole in
# the next token and cut mid-tag), the full suite serves all fourteen.
FAST_SPLITS = {"qwen3-2-6", "qwen3-3-1", "r1-0", "r1-4"}
SPLITS = [("qwen3", QWEN3_TEMPLATE, False, k, (k * 3) % 8) for k in range(1, 7)]
SPLITS += [("r1", R1_TEMPLATE, True, 0, k) for k in range(0, 8)]


def _split_id(name: str, open_at: int, close_at: int) -> str:
    return f"{name}-{open_at}-{close_at}" if name == "qwen3" else f"{name}-{close_at}"


@pytest.mark.parametrize(
    "template, opened, open_at, close_at",
    [
        pytest.param(
            t, o, a, c, id=_split_id(n, a, c), marks=() if _split_id(n, a, c) in FAST_SPLITS else pytest.mark.slow
        )
        for n, t, o, a, c in SPLITS
    ],
)
def test_thinking_apart_under_every_split(tokenizer, threads, template, opened, open_at, close_at):
    pieces = cut(open_at, close_at, opened)
    tok, model = served(tokenizer, template, pieces)
    backend = Backend(tok, model)
    try:
        whole, deltas = ask(backend)
    finally:
        backend.close()
    assert whole["message"]["reasoning_content"] == ANSWER_THINKING
    assert whole["message"]["content"] == ANSWER and whole["finish_reason"] == "stop"
    thinking = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert (thinking, content) == (ANSWER_THINKING, ANSWER)
    assert deltas[-1]["finish_reason"] == "stop"


def test_length_cut_inside_thinking_and_tools_from_the_answer(tokenizer, threads):
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    pieces = ["<think>", "Call f", "<tool_call>?", "</think>", call]
    tok, model = served(tokenizer, QWEN3_TEMPLATE, pieces)
    backend = Backend(tok, model)
    try:
        whole, deltas = ask(backend, max_tokens=3)
        assert whole["message"] == {"role": "assistant", "content": None, "reasoning_content": "Call f<tool_call>?"}
        assert whole["finish_reason"] == "length" and deltas[-1]["finish_reason"] == "length"
        assert not any(d["delta"].get("content") for d in deltas)
    finally:
        backend.close()
    backend = Backend(tok, model)
    try:  # the tool call in the thinking is not a call; the one in the answer is
        tools = [{"type": "function", "function": {"name": "f"}}]
        whole, deltas = ask(backend, tools=tools)
    finally:
        backend.close()
    assert whole["message"]["reasoning_content"] == "Call f<tool_call>?" and whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["f"]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "Call f<tool_call>?"
    assert [d["delta"]["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d["delta"]] == ["f"]


def named_events(frames) -> list[tuple[str, dict]]:
    out = []
    for block in body_of(frames).decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_messages_and_responses_keep_the_thinking_apart(tokenizer, threads):
    """The same split through Anthropic's Messages (thinking blocks) and OpenAI's Responses
    (reasoning items), streamed and not, with the tags split across tokens; count_tokens counts
    the prompt the engine serves; an error keeps each protocol's shape."""
    tok, model = served(tokenizer, QWEN3_TEMPLATE, cut(3, 5, False))
    backend = Backend(tok, model)
    user = [{"role": "user", "content": "Is 2 < 3?"}]
    messages = {"model": "tiny", "max_tokens": 50, "messages": user, "temperature": 0}
    responses = {"model": "tiny", "input": "Is 2 < 3?", "temperature": 0}

    async def run():
        await asyncio.gather(
            backend.request("msg", messages, "v1/messages"),
            backend.request("msg-sse", {**messages, "stream": True}, "v1/messages"),
            backend.request("count", {"messages": user}, "v1/messages/count_tokens"),
            backend.request("resp", responses, "v1/responses"),
            backend.request("resp-sse", {**responses, "stream": True}, "v1/responses"),
            backend.request("bad-msg", {"messages": user}, "v1/messages"),
            backend.request("bad-resp", {**responses, "previous_response_id": "resp_1"}, "v1/responses"),
        )

    try:
        asyncio.run(run())
        frames = backend.frames()
    finally:
        backend.close()
    msg = json.loads(body_of(frames["msg"]))
    assert msg["content"] == [
        {"type": "thinking", "thinking": ANSWER_THINKING, "signature": ""},
        {"type": "text", "text": ANSWER},
    ]
    assert msg["stop_reason"] == "end_turn"
    assert json.loads(body_of(frames["count"])) == {"input_tokens": msg["usage"]["input_tokens"]}
    seen = named_events(frames["msg-sse"])
    deltas = [d["delta"] for n, d in seen if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == ANSWER_THINKING
    assert "".join(d.get("text", "") for d in deltas) == ANSWER
    assert seen[0][0] == "message_start" and seen[-1][0] == "message_stop"
    resp = json.loads(body_of(frames["resp"]))
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message"]
    assert resp["output"][0]["content"][0]["text"] == ANSWER_THINKING
    assert resp["output"][1]["content"][0]["text"] == ANSWER
    # `<th`, `ink>\nI thi`, `nk 2 < 3.\n</thi`, `nk>\n\nYe`: the fourth token completes `</think>`
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    seen = named_events(frames["resp-sse"])
    assert "".join(d["delta"] for n, d in seen if n == "response.reasoning_text.delta") == ANSWER_THINKING
    assert "".join(d["delta"] for n, d in seen if n == "response.output_text.delta") == ANSWER
    streamed = json.loads(json.dumps(seen[-1][1]["response"]["output"]).replace("resp-sse", "resp"))
    assert streamed == resp["output"]  # the same items, named after their own request
    bad = frames["bad-msg"][0]
    assert bad["status"] == 400 and json.loads(bad["body"])["error"]["type"] == "invalid_request_error"
    assert json.loads(bad["body"])["type"] == "error"
    bad = frames["bad-resp"][0]
    assert bad["status"] == 400 and json.loads(bad["body"])["error"]["param"] == "previous_response_id"

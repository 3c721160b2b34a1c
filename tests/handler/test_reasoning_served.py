"""Reasoning through the handler and a real engine: a tiny model made to say a chosen answer token
by token, its think tags split across tokens at every position, in chat completions streamed and
not (`reasoning_content` apart from `content`), with tool calls parsed from the answer alone and
a length cut inside the thinking."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from test_orca_handler import Backend, body_of
from test_reasoning import QWEN3_TEMPLATE, R1_TEMPLATE

from orcaserve.bench.models.tiny import TINY_CONFIG

ANSWER_THINKING = "I think 2 < 3."
ANSWER = "Yes."


def chain_model(vocab: int, chain: list[int]):
    """A tiny llama whose greedy next token depends on the current token alone: `chain[k]` is
    followed by `chain[k + 1]`. Attention and MLP write nothing (o_proj, down_proj zero), so the
    last hidden state is the token's normed embedding, and lm_head's row of each successor is it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "vocab_size": vocab})).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        hidden = emb.shape[1]
        for token, after in zip(chain, chain[1:], strict=False):
            normed = emb[token] / emb[token].pow(2).mean().sqrt()
            head[after] += 20 * normed / hidden  # logit 20 after `token`, about 0 for the rest
    return model


def served(tokenizer, template: str, pieces: list[str]):
    """(tokenizer, model) answering `pieces`, one token each, then EOS, to the template's prompt."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    tok.add_tokens([p for p in pieces if len(tok.encode(p, add_special_tokens=False)) != 1])
    ids = [tok.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids), pieces
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Is 2 < 3?"}], tokenize=False, add_generation_prompt=True
    )
    last = tok.encode(text, add_special_tokens=False)[-1]
    chain = [last, *(i[0] for i in ids), tok.eos_token_id]
    assert len(set(chain)) == len(chain), pieces  # each token has one successor
    return tok, chain_model(len(tok), chain)


def cut(open_at: int, close_at: int, opened: bool) -> list[str]:
    """The answer's pieces: `<think>` split at `open_at`, `</think>` at `close_at` (glued to the
    text beside them, so every piece is a distinct token)."""
    start = ["<think>"[:open_at], "<think>"[open_at:] + "\n" + ANSWER_THINKING[:5]]
    if opened:
        start = [ANSWER_THINKING[:5]]
    middle = [ANSWER_THINKING[5:] + "\n" + "</think>"[:close_at]]
    return [*start, *middle, "</think>"[close_at:] + "\n\n" + ANSWER[:2], ANSWER[2:]]


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


@pytest.mark.parametrize(
    "template, opened, open_at, close_at",
    [(QWEN3_TEMPLATE, False, k, (k * 3) % 8) for k in range(1, 7)] + [(R1_TEMPLATE, True, 0, k) for k in range(0, 8)],
    ids=[f"qwen3-{k}-{(k * 3) % 8}" for k in range(1, 7)] + [f"r1-{k}" for k in range(0, 8)],
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

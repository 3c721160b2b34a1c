"""The exact bytes a client receives, answer by answer: `OrcaHandler.handle` over scripted engine
outputs (a fake engine loop), recording every frame, status, header and content type the
TorchServe layer writes. Covers what the end-to-end tests check only in parts: streamed and not,
`n` choices interleaved, echo with prompt log-probabilities, chat log-probabilities, tool calls
parsed from held-back text, the usage chunk, and each error before and after a stream opened;
Anthropic's Messages and OpenAI's Responses in their own shapes.

The expected values (`answer_bytes.json` beside this file) are what the handler wrote before the
OpenAI shaping moved into `handler/openai/shaper.py`: this script run against that code.
`python tests/handler/test_answer_bytes.py > tests/handler/answer_bytes.json` writes them again; a change that
moves any byte must show up in that file's diff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ts")

from orcaserve.handler.config import HandlerConfig  # noqa: E402
from orcaserve.handler.openai import tools  # noqa: E402
from orcaserve.handler.openai.logprobs import LogprobsRenderer  # noqa: E402
from orcaserve.handler.orca_handler import OrcaHandler  # noqa: E402
from orcaserve.handler.torchserve.reply import Reply  # noqa: E402
from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes  # noqa: E402
from orcaserve.scheduler.errors import InternalError, Overloaded, TimedOut  # noqa: E402
from orcaserve.scheduler.model.logprobs import TokenLogprob  # noqa: E402

CREATED = 1_700_000_000
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'


class Tokenizer:
    """Token id k is the letter chr(97 + k % 26)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def lp(token: int, top: int | None = None) -> TokenLogprob:
    return TokenLogprob(token, -0.25 * (token % 4 + 1), () if top is None else ((top, -0.125),))


def out(text: str, index: int = 0, done: str | None = None, final: str = "", **kw: Any) -> RequestOutput:
    """An output of choice `index`: `text` new; finished with reason `done` (whole answer `final`)."""
    ids = [ord(c) - 97 for c in text]
    return RequestOutput(
        "rid", ids, [ord(c) - 97 for c in final] if done else [], text, final if done else "", done is not None,
        done, 3, len(final) if done else 0, RequestTimes(1.0, 1.0, 1.0, 1.0 if done else None), index=index, **kw,
    )  # fmt: skip


class Stream:
    """What `EngineLoop.submit` returns: the scripted frames, then `error` if set."""

    def __init__(self, frames: list[list[RequestOutput]], error: Exception | None) -> None:
        self.frames, self.error, self.finished = frames, error, False

    async def chunks(self) -> AsyncIterator[list[RequestOutput]]:
        for frame in self.frames:
            yield frame
        if self.error is not None:
            raise self.error
        self.finished = True

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for frame in self.chunks():
            for o in frame:
                yield o

    async def follow(self, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        async for frame in self.chunks():
            on_outputs(frame)


class Loop:
    alive = True

    def __init__(self, stream: Stream | Exception) -> None:
        self.stream = stream
        self.engine = type("E", (), {"max_model_len": 64})()

    def submit(self, *args: Any, **kwargs: Any) -> Stream:
        if isinstance(self.stream, Exception):
            raise self.stream
        return self.stream

    def abort(self, request_id: str) -> None:
        pass


class Context:
    """The TorchServe context calls the handler makes, recorded in order."""

    def __init__(self, path: str) -> None:
        self.log: list[list] = []
        self.headers = {"url_path": path}

    def get_request_id(self, idx: int) -> str:
        return "rid"

    def get_request_header(self, idx: int, name: str) -> str | None:
        return self.headers.get(name)

    def get_all_request_header(self, idx: int) -> dict:
        return self.headers

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.log.append(["content-type", value])

    def set_response_header(self, idx: int, name: str, value: str) -> None:
        self.log.append(["header", name, value])

    def set_response_status(self, code: int, phrase: str, idx: int) -> None:
        self.log.append(["status", code, phrase])


def _record(reply: Reply, text: str, kind: str) -> None:
    reply.context.log.append([kind, text])
    reply.started = True


def answer(path: str, body: dict, stream: Stream | Exception) -> list[list]:
    """Everything `handle` writes for one request: context calls, frames, and the final body."""
    handler = OrcaHandler()
    handler.initialized, handler.model_name = True, "m"
    handler.config = HandlerConfig("unused", {}, default_timeout=60)
    handler.metrics = type("M", (), {"on_finish": lambda self, o: None})()
    handler._logprobs = LogprobsRenderer(Tokenizer())
    handler.engine_loop = Loop(stream)  # type: ignore[assignment]
    context = Context(path)
    final = asyncio.run(handler.handle([{"body": body}], context))
    return [*context.log, ["final", final[0]]]


def s(*frames: list[RequestOutput], error: Exception | None = None) -> Stream:
    return Stream(list(frames), error)


CHAT_PATH, COMPLETIONS_PATH = "v1/chat/completions", "v1/completions"
MESSAGES_PATH, RESPONSES_PATH = "v1/messages", "v1/responses"
ANTHROPIC_TOOLS = [{"name": "get_time", "input_schema": {"type": "object"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
PROMPT_LOGPROBS = {"prompt_token_ids": [1, 2], "prompt_logprobs": [None, lp(2, 3)]}
CASES: dict[str, tuple[str, dict, Any]] = {
    "completions_n2_echo_logprobs": (
        COMPLETIONS_PATH,
        {"prompt": [1, 2], "n": 2, "echo": True, "logprobs": 1},
        s(
            [
                out("", 0, "length", "cd", logprobs=[lp(2, 3), lp(3, 2)], **PROMPT_LOGPROBS),
                out("", 1, "stop", "e", logprobs=[lp(4, 5)], **PROMPT_LOGPROBS),
            ]
        ),
    ),
    "completions_stream_n2_echo_logprobs_usage": (
        COMPLETIONS_PATH,
        {"prompt": "ab", "n": 2, "echo": True, "logprobs": 1, "stream": True}
        | {"stream_options": {"include_usage": True}},
        s(
            [out("c", 0, new_logprobs=[lp(2, 3)], **PROMPT_LOGPROBS), out("d", 1, new_logprobs=[lp(3, 4)])],
            [out("e", 1, "stop", "de", new_logprobs=[lp(4, 5)])],
            [out("f", 0, "length", "cf", new_logprobs=[lp(5, 6)])],
        ),
    ),
    "chat_logprobs_timeout_reason": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1},
        s([out("", 0, "timeout", "ab", logprobs=[lp(0, 1), lp(1, 0)])]),
    ),
    "chat_stream_logprobs": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True},
        s([out("a", new_logprobs=[lp(0)])], [out("b", 0, "stop", "ab", new_logprobs=[lp(1)])]),
    ),
    "chat_tools": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "time?"}], "tools": TOOLS},
        s([out("", 0, "stop", "Sure." + CALL)]),
    ),
    "chat_stream_tools_n2_usage": (
        CHAT_PATH,
        {
            "messages": [{"role": "user", "content": "time?"}],
            "tools": TOOLS,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        s(
            [out("Sure.", 0), out("No.", 1)],
            [out(CALL, 0, "stop", "Sure." + CALL), out("", 1, "stop", "No.")],
        ),
    ),
    "stream_error_after_first_frame": (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        s([out("a")], error=InternalError("internal error: RuntimeError: injected")),
    ),
    "stream_error_opened_nothing_sent": (
        COMPLETIONS_PATH,
        {"prompt": "ab", "stream": True},
        s([out("")], error=InternalError("internal error: RuntimeError: injected")),
    ),
    "stream_timeout_before_first_token": (
        COMPLETIONS_PATH,
        {"prompt": "ab", "stream": True},
        s(error=TimedOut(1.5)),
    ),
    "stream_ends_without_final": (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "stream": True}, s()),
    "overloaded": (COMPLETIONS_PATH, {"prompt": "ab"}, Overloaded("server overloaded: 2 waiting", retry_after=1)),
    "unknown_field": (COMPLETIONS_PATH, {"prompt": "ab", "max_token": 3}, s()),
    "unknown_path": ("v1/embeddings", {"input": "ab"}, s()),
    "bug": (COMPLETIONS_PATH, {"prompt": "ab"}, RuntimeError("boom")),
    "non_streamed_without_output": (COMPLETIONS_PATH, {"prompt": "ab", "n": 2}, s([out("", 0, "stop", "a")])),
    "models": ("v1/models", {}, s()),
    # Anthropic's Messages and OpenAI's Responses (handler/protocols.py): their answers, events and
    # errors in their own shapes, before and after a stream opened.
    "messages_tools": (
        MESSAGES_PATH,
        {"max_tokens": 9, "messages": [{"role": "user", "content": "time?"}], "tools": ANTHROPIC_TOOLS},
        s([out("", 0, "stop", "Sure." + CALL)]),
    ),
    "messages_stream_stop_sequence": (
        MESSAGES_PATH,
        {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "stream": True, "stop_sequences": ["z"]},
        s([out("a")], [dataclasses.replace(out("b", 0, "stop", "ab"), output_token_ids=[0, 1, 25])]),  # "ab" + "z"
    ),
    "messages_stream_error_after_first_frame": (
        MESSAGES_PATH,
        {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        s([out("a")], error=InternalError("internal error: RuntimeError: injected")),
    ),
    "messages_refused": (MESSAGES_PATH, {"messages": [{"role": "user", "content": "hi"}]}, s()),
    "messages_overloaded": (
        MESSAGES_PATH,
        {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]},
        Overloaded("server overloaded: 2 waiting", retry_after=1),
    ),
    "responses_cut": (RESPONSES_PATH, {"input": "hi", "max_output_tokens": 2}, s([out("", 0, "length", "ab")])),
    "responses_stream_tools": (
        RESPONSES_PATH,
        {"input": "time?", "tools": RESPONSES_TOOLS, "stream": True},
        s([out("Sure.")], [out(CALL, 0, "stop", "Sure." + CALL)]),
    ),
    "responses_stream_error_after_first_frame": (
        RESPONSES_PATH,
        {"input": "hi", "stream": True},
        s([out("a")], error=InternalError("internal error: RuntimeError: injected")),
    ),
    "responses_refused": (RESPONSES_PATH, {"input": "hi", "previous_response_id": "resp_1"}, s()),
}


def _call_ids() -> Any:
    calls = iter(range(1, 1000))
    return lambda: uuid.UUID(int=next(calls))  # tool call ids, numbered from 1


@pytest.fixture
def fixed(monkeypatch):
    """A fixed clock and tool call ids; frames recorded instead of written to a socket."""
    import time

    monkeypatch.setattr(time, "time", lambda: float(CREATED))
    monkeypatch.setattr(Reply, "send", lambda self, text: _record(self, text, "frame"))
    monkeypatch.setattr(Reply, "send_complete", lambda self, text: _record(self, text, "complete"))
    return monkeypatch


@pytest.mark.parametrize("name", list(CASES))
def test_each_answer_is_byte_for_byte_the_same(fixed, name):
    path, body, stream = CASES[name]
    fixed.setattr(tools.uuid, "uuid4", _call_ids())
    golden = json.loads(Path(__file__).with_name("answer_bytes.json").read_text())
    assert answer(path, body, stream) == golden[name]


if __name__ == "__main__":
    import time

    time.time = lambda: float(CREATED)
    Reply.send = lambda self, text: _record(self, text, "frame")  # type: ignore[method-assign]
    Reply.send_complete = lambda self, text: _record(self, text, "complete")  # type: ignore[method-assign]
    results = {}
    for name, (path, body, stream) in CASES.items():
        tools.uuid.uuid4 = _call_ids()  # type: ignore[attr-defined]
        results[name] = answer(path, body, stream)
    json.dump(results, sys.stdout, indent=1, ensure_ascii=False)
    print()

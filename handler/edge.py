"""The protocols besides OpenAI's completions and chat completions, as objects in a table from URL
path to protocol: each translates its request into a chat completions body (parsed and served as
any chat request: one internal request) and shapes one `Answer` (answer.py: one internal output)
into its own answer, events and errors (docs/protocols.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from orcaserve.handler.answer import Answer, AnswerParts, Part, stop_sequence_of, whole_answer
from orcaserve.handler.anthropic import messages as anthropic
from orcaserve.handler.anthropic.request import chat_body as anthropic_chat_body
from orcaserve.handler.openai import responses_api
from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.protocol import ParsedRequest
from orcaserve.handler.reasoning import ReasoningStyle
from orcaserve.handler.torchserve.reply import Reply
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import EngineError, InternalError
from orcaserve.scheduler.serving.prompt import encode_prompt
from orcaserve.scheduler.serving.request_stream import RequestStream


class Events(Protocol):
    """A streamed answer's events in a protocol's shape."""

    def start(self, prompt_tokens: int) -> str: ...
    def part(self, part: Part) -> str: ...
    def error(self, status: int, openai_body: dict) -> str: ...


@dataclass(frozen=True)
class Edge:
    """One protocol at the edge. `to_chat(body)`: the chat completions body it means and the
    fields accepted but ignored; `answer(request_id, model, answer)`: the non-streamed body;
    `events(request_id, model)`: the streamed answer's writer; `error(status, openai_body)`: an
    error in its shape; `counts_tokens`: answers the prompt's token count instead."""

    name: str
    to_chat: Callable[[dict], tuple[dict, tuple[str, ...]]]
    answer: Callable[[str, str, Answer], dict]
    events: Callable[[str, str], Events]
    error: Callable[[int, dict], dict]
    counts_tokens: bool = False


ANTHROPIC = Edge("anthropic", anthropic_chat_body, anthropic.message, anthropic.MessageEvents, anthropic.error_body)
ANTHROPIC_COUNT = Edge(
    "anthropic-count",
    lambda body: anthropic_chat_body(body, count_only=True),
    anthropic.message,
    anthropic.MessageEvents,
    anthropic.error_body,
    counts_tokens=True,
)
RESPONSES = Edge(
    "responses",
    responses_api.chat_body,
    responses_api.response,
    responses_api.ResponseEvents,
    lambda status, body: body,  # OpenAI's own error shape
)
EDGES: dict[str, Edge] = {
    "v1/messages": ANTHROPIC,
    "v1/messages/count_tokens": ANTHROPIC_COUNT,
    "v1/responses": RESPONSES,
}


def edge_for(url_path: str | None) -> Edge | None:
    """The protocol a URL suffix (TorchServe's `url_path` header) selects; None: OpenAI's chat
    completions, completions or models (openai/protocol.py `route`)."""
    path = (url_path or "").strip("/")
    return EDGES.get(path) or EDGES.get(f"v1/{path}")


async def count_tokens(tokenizer: Any, req: ParsedRequest, vocab_size: int, max_model_len: int) -> str:
    """`count_tokens`' answer: the prompt's tokens as the engine would encode them (off the asyncio
    thread, on a tokenizer of the handler's own); a prompt that would not fit is a 400 as well."""
    ids = await asyncio.to_thread(encode_prompt, tokenizer, req.prompt, vocab_size, max_model_len)
    return json.dumps({"input_tokens": len(ids)})


async def relay(
    edge: Edge,
    stream: RequestStream,
    req: ParsedRequest,
    reply: Reply,
    request_id: str,
    model: str,
    style: ReasoningStyle | None,
    decode: Callable[[list[int]], str],
    on_finish: Callable[[RequestOutput], Any],
) -> str:
    """The request's answer in `edge`'s shape: one body, or its events as tokens arrive (the
    last frame returned). Errors before the first event are real HTTP statuses (raised).
    `decode`: token ids to text, to tell which stop string ended an answer."""
    stops = req.params.stop

    def stop_sequence(final: RequestOutput) -> str | None:
        return stop_sequence_of(stops, decode(final.output_token_ids), final.text) if stops else None

    if not req.stream:
        final = None
        async for out in stream:
            final = out if out.finished else final
        if final is None:
            raise InternalError("the request ended without output")
        on_finish(final)
        reply.context.set_response_content_type(0, "application/json")
        return json.dumps(edge.answer(request_id, model, whole_answer(final, req, style, stop_sequence)))
    writer, parts = edge.events(request_id, model), AnswerParts(req, style, stop_sequence)
    started = False
    try:
        async for outputs in stream.chunks():
            frame = ""
            if not started:
                reply.context.set_response_content_type(0, "text/event-stream")
                frame, started = writer.start(outputs[0].prompt_tokens), True
            for out in outputs:
                frame += "".join(writer.part(part) for part in parts.feed(out))
                if out.finished:
                    on_finish(out)
                    return frame
            if frame:
                reply.send(frame)
    except EngineError as e:
        if not started:
            raise
        answer = http_error(e)  # the 200 went out with the first event: the error is in-band
        return writer.error(answer.status, answer.body)
    raise InternalError("the request stream ended without a final output")

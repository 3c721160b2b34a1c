"""Chat completions' `reasoning_content` (vLLM's field): a reasoning model's thinking beside the
answer's `content`, in the message and as deltas of their own when streamed
(docs/protocols.md, 'Reasoning'). Models without a reasoning parser answer as before: no field."""

from __future__ import annotations

import dataclasses

from orcaserve.handler.openai.protocol import CHAT, ParsedRequest, ProtocolError
from orcaserve.handler.reasoning import ReasoningSplitter, ReasoningStyle, constrained_kwargs, split
from orcaserve.scheduler.prompt import ChatPrompt


def prepare(style: ReasoningStyle | None, req: ParsedRequest) -> ParsedRequest:
    """A chat request as a model with `style` serves it: a constrained answer (structured
    outputs, a forced tool call) is asked to skip the thinking; ProtocolError (400) where it
    cannot be."""
    constraint = req.params.structured_outputs
    if style is None or req.kind != CHAT or constraint is None or not isinstance(req.prompt, ChatPrompt):
        return req
    try:
        kwargs = constrained_kwargs(style, req.prompt.template_kwargs)
    except ValueError as e:
        raise ProtocolError(str(e), constraint.param) from None
    prompt = dataclasses.replace(req.prompt, template_kwargs=kwargs)
    return dataclasses.replace(req, request=dataclasses.replace(req.request, prompt=prompt))


def split_text(style: ReasoningStyle | None, kind: str, text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a whole choice's text; thinking None when the model has no parser."""
    if style is None or kind != CHAT:
        return None, text
    return split(style, text)


def with_reasoning(choice: dict, thinking: str | None) -> dict:
    """A non-streamed chat choice (tool calls already parsed from its answer) with its thinking."""
    if thinking is None:
        return choice
    message = choice["message"]
    message["reasoning_content"] = thinking or None
    if message.get("content") == "":
        message["content"] = None
    return choice


class StreamedReasoning:
    """A streamed request's splitters, one per choice."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self._splitters: dict[int, ReasoningSplitter] = {}

    def feed(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) of choice `index`'s next text; `finished`: its last."""
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.style))
        thinking, answer = splitter.feed(text)
        if finished:
            more = splitter.finish()
            thinking, answer = thinking + more[0], answer + more[1]
        return thinking, answer


def streamed(style: ReasoningStyle | None, req: ParsedRequest) -> StreamedReasoning | None:
    return StreamedReasoning(style) if style is not None and req.kind == CHAT else None


def add_thinking(chunk: dict, thinking: str) -> dict:
    """A chat chunk carrying `thinking` as its delta's `reasoning_content` (and no empty content)."""
    if thinking:
        delta = chunk["choices"][0]["delta"]
        if delta.get("content") == "":
            del delta["content"]
        delta["reasoning_content"] = thinking
    return chunk

"""One answer, whatever protocol asked for it: a request's engine outputs as thinking, text, tool
calls and a finish reason, whole or part by part as they stream. Anthropic's Messages and
OpenAI's Responses (handler/edge.py) shape these parts; the thinking is split by reasoning.py and
the tool calls are parsed by the chat completions' own ToolSpec (openai/tools.py)
(docs/protocols.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orcaserve.handler.openai.protocol import ParsedRequest
from orcaserve.handler.openai.responses import openai_finish_reason
from orcaserve.handler.reasoning import ReasoningSplitter, ReasoningStyle
from orcaserve.scheduler.core.outputs import RequestOutput


@dataclass
class Answer:
    """A finished answer. `tool_calls` in OpenAI's shape (`{"id", "type", "function": {"name",
    "arguments"}}`, arguments as JSON text); `finish_reason` one of OpenAI's (stop, length,
    tool_calls); `stop_sequence`: the stop string that ended it, when one did; `reasoning_tokens`:
    how many of its tokens are the thinking (set by the shaper that can decode them)."""

    thinking: str | None
    text: str
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_sequence: str | None = None
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Part:
    """One piece of a streamed answer: `kind` thinking | text (`value` the new text), tool_call
    (`call` one whole call), or end (`answer` the finished answer, its text the whole text)."""

    kind: str
    value: str = ""
    call: dict | None = None
    answer: Answer | None = None


class AnswerParts:
    """A request's outputs (one choice) in, `Part`s out; text is held back where the request's
    tools parse it at the end. `stop_sequence(final)` says which stop string ended an answer."""

    def __init__(self, req: ParsedRequest, style: ReasoningStyle | None, stop_sequence=None) -> None:
        self.req = req
        self._splitter = ReasoningSplitter(style) if style is not None else None
        self._thinking: list[str] | None = [] if style is not None else None
        self._text: list[str] = []
        self._holds = req.tool_spec is not None and req.tool_spec.parses
        self._stop_sequence = stop_sequence

    def feed(self, out: RequestOutput) -> list[Part]:
        text, thinking = out.new_text, ""
        if self._splitter is not None:
            thinking, text = self._splitter.feed(text)
            if out.finished:
                more = self._splitter.finish()
                thinking, text = thinking + more[0], text + more[1]
        parts = []
        if thinking:
            assert self._thinking is not None
            self._thinking.append(thinking)
            parts.append(Part("thinking", thinking))
        if text:
            self._text.append(text)
            if not self._holds:
                parts.append(Part("text", text))
        if out.finished:
            answer = self._finish(out)
            if self._holds:
                parts += [Part("text", answer.text)] if answer.text else []
                parts += [Part("tool_call", call=call) for call in answer.tool_calls]
            parts.append(Part("end", answer=answer))
        return parts

    def _finish(self, final: RequestOutput) -> Answer:
        text: str | None = "".join(self._text)
        reason = openai_finish_reason(final.finish_reason) or "stop"
        calls: list[dict] = []
        spec = self.req.tool_spec
        if spec is not None and spec.parses:
            text, calls, parsed_reason = spec.parse(text or "", reason)
            reason = parsed_reason or reason
        stop = self._stop_sequence(final) if self._stop_sequence is not None and reason == "stop" else None
        thinking = "".join(self._thinking) if self._thinking is not None else None
        return Answer(
            thinking,
            text or "",
            calls,
            reason,
            final.prompt_tokens,
            final.completion_tokens,
            final.num_cached_tokens,
            stop,
        )


def whole_answer(final: RequestOutput, req: ParsedRequest, style: ReasoningStyle | None, stop_sequence=None) -> Answer:
    """The answer of a request answered once finished (its final output carries the whole text)."""
    parts = AnswerParts(req, style, stop_sequence)
    whole = dataclasses.replace(final, new_text=final.text)
    end = parts.feed(whole)[-1]
    assert end.answer is not None
    return end.answer


def stop_sequence_of(stops: list[str], full_text: str, text: str) -> str | None:
    """Which of `stops` ended an answer whose tokens decode to `full_text` and whose text (cut
    before the stop string) is `text`; None when none did (an end-of-sequence token)."""
    tail = full_text[len(text) :] if full_text.startswith(text) else full_text
    found = [(tail.find(s), s) for s in stops if s in tail]
    return min(found)[1] if found else None

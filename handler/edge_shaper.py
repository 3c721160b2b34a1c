"""The shaper of the protocols besides OpenAI's chat completions (Anthropic's Messages, OpenAI's
Responses): the seams of openai/shaper.py's `Shaper` (`response`, `events`, `done`,
`error_event`), built on one `Answer` (answer.py: thinking, text, tool calls, finish reason,
usage) that each protocol writes in its own shape (docs/protocols.md, "One request, one answer").
These protocols have one choice (`n` is not theirs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Protocol

from orcaserve.handler.answer import Answer, AnswerParts, Part, stop_sequence_of, whole_answer
from orcaserve.handler.openai.errors import HttpError
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.handler.openai.protocol import ParsedRequest
from orcaserve.handler.reasoning import THINK_END, ReasoningStyle
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import InternalError


class Events(Protocol):
    """A streamed answer's events in one protocol's shape."""

    def start(self, prompt_tokens: int) -> str: ...
    def part(self, part: Part) -> str: ...
    def error(self, error: HttpError) -> str: ...


class EdgeShaper:
    """Shapes one request's outputs with a protocol's `answer` (the non-streamed body of one
    `Answer`) and `writer` (its events). Stop strings are told apart by decoding the answer's
    tokens (`renderer`), for the protocols that name the one that ended an answer."""

    def __init__(
        self,
        answer: Callable[[str, str, Answer], dict],
        writer: Callable[[str, str], Events],
        req: ParsedRequest,
        request_id: str,
        model: str,
        renderer: LogprobsRenderer | None,
        style: ReasoningStyle | None,
    ) -> None:
        self.req, self.request_id, self.model, self.style = req, request_id, model, style
        self._answer, self._renderer = answer, renderer
        self._writer = writer(request_id, model)
        self._parts = AnswerParts(req, style, self._stop_sequence)
        self.opened = False
        self.done = False

    def _stop_sequence(self, final: RequestOutput) -> str | None:
        stops = self.req.params.stop
        if not stops or self._renderer is None:
            return None
        return stop_sequence_of(stops, self._renderer.decode(list(final.output_token_ids)), final.text)

    def _count_thinking(self, final: RequestOutput, answer: Answer) -> None:
        """Set how many of the answer's tokens are its thinking: those up to the one that completes
        `</think>`, or all of them when the answer ended inside the thinking."""
        ids = list(final.output_token_ids)
        if not answer.thinking or self._renderer is None or not ids:
            return
        low, high = 1, len(ids) + 1  # the fewest tokens whose text holds `</think>`; len + 1: none do
        while low < high:
            mid = (low + high) // 2
            if THINK_END in self._renderer.decode(ids[:mid]):
                high = mid
            else:
                low = mid + 1
        answer.reasoning_tokens = min(low, len(ids))

    def response(self, finals: dict[int, RequestOutput]) -> str:
        """The JSON answer from the final output."""
        if set(finals) != {0}:
            raise InternalError("the request ended without output")
        answer = whole_answer(finals[0], self.req, self.style, self._stop_sequence)
        self._count_thinking(finals[0], answer)
        return json.dumps(self._answer(self.request_id, self.model, answer))

    def events(self, outputs: list[RequestOutput]) -> str:
        """The events for the outputs that piled up since the last frame; the first call opens
        the stream, the one with the final output closes it (`done`)."""
        pieces = []
        if not self.opened:
            pieces.append(self._writer.start(outputs[0].prompt_tokens))
            self.opened = True
        for out in outputs:
            for part in self._parts.feed(out):
                if part.answer is not None:  # the end: the whole answer, its tokens in `out`
                    self._count_thinking(out, part.answer)
                pieces.append(self._writer.part(part))
            if out.finished:
                self.done = True
                break
        return "".join(pieces)

    def error_event(self, error: HttpError) -> str:
        """An error once the stream's 200 went out (`error` already in the protocol's shape)."""
        return self._writer.error(error)

"""One request's answer in its endpoint's shape, from the engine's outputs: the JSON of a
non-streamed answer, or a streamed answer's Server-Sent Events frame by frame. One shaper per
endpoint kind, chosen from `SHAPERS`; independent of TorchServe (docs/serving.md, "Where the
protocol lives").

The shaper owns what an answer carries beyond the tokens' text: `n` choices interleaved by index,
chat's opening role delta, the echoed prompt (completions), log-probabilities in each API's shape
with their text offsets, tool calls parsed from held-back text at a choice's end (`tools.py`), a
reasoning model's thinking apart from the answer (`reasoning_content.py`), the trailing usage chunk
and an error once the stream is open. The other protocols' shapers have the same seams
(handler/protocols.py)."""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring
from typing import Any

from orcaserve.handler.openai import reasoning_content
from orcaserve.handler.openai.choices import by_choice, usage
from orcaserve.handler.openai.errors import HttpError
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.handler.openai.protocol import CHAT, COMPLETIONS, ParsedRequest
from orcaserve.handler.openai.responses import SSE_DONE, choice, response_of, sse, stream_chunk, usage_of
from orcaserve.handler.openai.tools import shape_choice, stream_tail
from orcaserve.handler.reasoning import ReasoningStyle
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import InternalError
from orcaserve.scheduler.model.logprobs import TokenLogprob

_MARK = "\ue000orcaserve-text\ue000"  # private-use characters: JSON keeps them as they are
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False)


class Shaper:
    """Shapes one request's outputs; the endpoint kinds differ in `_opening`, `_logprobs` and
    `_TEXT_END` only. A streamed answer is `opened` by its first frame and `done` once every
    choice finished (its last frame ends with `[DONE]`)."""

    KIND = ""
    _TEXT_END: str | None = None  # the text of a choice's finishing chunk

    def __init__(
        self,
        req: ParsedRequest,
        request_id: str,
        model: str,
        renderer: LogprobsRenderer | None,
        style: ReasoningStyle | None = None,
    ) -> None:
        self.req, self.request_id, self.model = req, request_id, model
        self._renderer = renderer
        self._style = style  # the model's reasoning parser (reasoning.py); None: no thinking apart
        self._thinking = reasoning_content.streamed(style, req)
        self.created = int(time.time())  # a stream's chunks all carry the second it started
        self.opened = False
        self.done = False
        self._offsets: dict[int, int] = {}  # per choice: where its next token's text starts (`text_offset`)
        self._finals: list[RequestOutput] = []
        self._held: dict[int, str] = {}  # per choice: text held back to be parsed into tool calls (tools.py)
        self._templates: dict[int, list[str]] = {}  # per choice: its text event around the text (`_text_event`)
        # New text goes out as it comes: no thinking apart, no tool calls held back (`events`).
        self._plain = self._thinking is None and not (req.tool_spec is not None and req.tool_spec.parses)

    # ---- non-streamed ------------------------------------------------------------------------
    def response(self, finals: dict[int, RequestOutput]) -> str:
        """The JSON answer from each choice's final output (index -> output)."""
        req = self.req
        if len(finals) != req.params.n:
            raise InternalError("the request ended without output")
        choices = []
        for i, final in sorted(finals.items()):
            echo = self._echo()
            logprobs = self._logprobs(final.logprobs, len(echo))[0]
            prompt_logprobs = self._echo_logprobs(final)
            if logprobs is not None and prompt_logprobs is not None:  # the prompt's, then the answer's
                logprobs = {key: prompt_logprobs[key] + value for key, value in logprobs.items()}
            thinking, text = reasoning_content.split_text(self._style, self.KIND, final.text)
            one = shape_choice(choice(self.KIND, i, echo + text, final.finish_reason, logprobs), req.tool_spec)
            choices.append(reasoning_content.with_reasoning(one, thinking))
        answer = response_of(self.KIND, self.request_id, self.model, choices, usage_of(*usage(finals.values())))
        return json.dumps(answer)

    # ---- streamed ----------------------------------------------------------------------------
    def events(self, outputs: list[RequestOutput]) -> str:
        """The SSE text for the outputs that piled up since the last frame ('' when there is
        nothing to say yet); the first call opens every choice, the one that finishes the last
        choice adds the usage chunk (when asked) and `[DONE]`."""
        if self._plain and self.opened and len(outputs) == 1:  # the common case, as below
            out = outputs[0]
            if not out.finished and not out.new_logprobs:
                return self._text_event(out.index, out.new_text) if out.new_text else ""
        req, pieces = self.req, []
        if not self.opened:
            for i in range(req.params.n):  # every choice opens: chat's role, the echoed prompt
                echo = self._echo()
                self._offsets[i] = len(echo)
                pieces += [sse(chunk) for chunk in self._opening(i, echo, outputs[0])]
            self.opened = True
        for index, group in by_choice(outputs):
            text = "".join(out.new_text for out in group)
            new_logprobs = [lp for out in group for lp in out.new_logprobs or ()]
            thought = ""
            if self._thinking is not None:  # the thinking apart, never in `content` (reasoning.py)
                thought, text = self._thinking.feed(index, text, group[-1].finished)
            if req.tool_spec is not None and req.tool_spec.parses:  # parsed into tool calls at the end
                self._held[index] = self._held.get(index, "") + text
                text, new_logprobs = "", []
            if text and not new_logprobs and not thought:  # the common event: new text alone
                pieces.append(self._text_event(index, text))
            elif text or new_logprobs or thought:  # a token's logprob goes out even while its text is held
                logprobs, self._offsets[index] = self._logprobs(new_logprobs or None, self._offsets[index])
                chunk = self._chunk(text, logprobs=logprobs, index=index)
                pieces.append(sse(reasoning_content.add_thinking(chunk, thought)))
            last = group[-1]
            if last.finished:
                self._finals.append(last)
                chunk = self._chunk(self._TEXT_END, last.finish_reason, index=index)
                held = self._held.pop(index, None)
                tail = [chunk] if held is None else stream_tail(req.tool_spec, held, chunk)
                pieces += [sse(c) for c in tail]
        if len(self._finals) == req.params.n:
            if req.include_usage:
                pieces.append(sse(self._chunk(usage=usage(self._finals))))
            pieces.append(SSE_DONE)
            self.done = True
        return "".join(pieces)

    def _text_event(self, index: int, text: str) -> str:
        """`sse(self._chunk(text, index=index))`, byte for byte, from the choice's event with its
        text cut out (built once): one string encoded per token instead of the chunk's dicts."""
        template = self._templates.get(index)
        if template is None:
            whole = sse(self._chunk(_MARK, index=index))
            template = self._templates[index] = whole.split(_MARK_JSON)
        if len(template) != 2:  # the marker met elsewhere (a model name): no template
            return sse(self._chunk(text, index=index))
        return encode_basestring(text).join(template)  # what json.dumps(text, ensure_ascii=False) returns

    def error_event(self, error: HttpError) -> str:
        """An error once the stream's 200 went out: in-band, as OpenAI's streaming API does."""
        return sse(error.body) + SSE_DONE

    def _chunk(self, text: str | None = None, finish_reason: str | None = None, **kw: Any) -> dict:
        return stream_chunk(self.KIND, self.request_id, self.model, self.created, text, finish_reason, **kw)

    # ---- what the endpoint kinds do differently ----------------------------------------------
    def _opening(self, index: int, echo: str, first: RequestOutput) -> list[dict]:
        """The chunks that open choice `index` of a stream, before its first token."""
        raise NotImplementedError

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> tuple[dict | None, int]:
        """A choice's `logprobs` in this API's shape (None when not asked), and the next text offset."""
        raise NotImplementedError

    # ---- the echoed prompt (completions' `echo`) ---------------------------------------------
    def _echo(self) -> str:
        """The prompt's text when the request asked for it back (`echo`), else ''."""
        req = self.req
        if not req.echo:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        assert self._renderer is not None and isinstance(req.prompt, list)
        return self._renderer.decode(req.prompt)

    def _echo_logprobs(self, out: RequestOutput) -> dict | None:
        """The completions `logprobs` of the echoed prompt, when the request asked for them."""
        if out.prompt_logprobs is None or out.prompt_token_ids is None or self._renderer is None:
            return None
        return self._renderer.echo(out.prompt_token_ids, out.prompt_logprobs)[0]


class CompletionsShaper(Shaper):
    """`text_completion` answers and chunks (`/v1/completions`)."""

    KIND = COMPLETIONS
    _TEXT_END = ""

    def _opening(self, index: int, echo: str, first: RequestOutput) -> list[dict]:
        if not echo:
            return []
        logprobs = self._echo_logprobs(first)  # every choice's first output has them
        return [self._chunk(echo, logprobs=logprobs, index=index)]

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> tuple[dict | None, int]:
        if logprobs is None or self._renderer is None:
            return None, offset
        return self._renderer.completion(logprobs, offset)


class ChatShaper(Shaper):
    """`chat.completion` answers and `chat.completion.chunk`s (`/v1/chat/completions`)."""

    KIND = CHAT
    _TEXT_END = None

    def _opening(self, index: int, echo: str, first: RequestOutput) -> list[dict]:
        return [self._chunk("", role=True, index=index)]

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> tuple[dict | None, int]:
        if logprobs is None or self._renderer is None:
            return None, offset
        return self._renderer.chat(logprobs), offset


# Endpoint kind (`protocol.route`) -> its shaper; a new endpoint kind is one class and one line.
SHAPERS: dict[str, type[Shaper]] = {COMPLETIONS: CompletionsShaper, CHAT: ChatShaper}


def shaper_for(
    req: ParsedRequest,
    request_id: str,
    model: str,
    renderer: LogprobsRenderer | None,
    style: ReasoningStyle | None = None,
) -> Shaper:
    """The shaper of `req`'s endpoint kind."""
    return SHAPERS[req.kind](req, request_id, model, renderer, style)

"""Reasoning kept apart from the answer: a model's `<think>...</think>` thinking, split from its
text piece by piece as tokens arrive (docs/protocols.md, 'Reasoning').

Two styles, one per model (`reasoning_parser` in model-config.yaml; `auto` picks from the chat
template where that is unambiguous):
- `qwen3`: the model opens its thinking itself; an answer that starts with `<think>` (after
  whitespace) thinks until `</think>`, any other answer is all content (Qwen3 with
  `enable_thinking: false` gets an empty think block in its prompt and answers directly).
- `deepseek_r1`: the prompt opens the thinking (the template ends with `<think>`); everything
  before `</think>` is thinking (a repeated `<think>` at the very start is dropped), and an answer
  cut before `</think>` is all thinking, its content empty.
Text pieces may split the tags anywhere: a piece that could still become a tag is held back until
it is known, so thinking never reaches the content, nor the reverse, under any tokenization.
Whitespace around the thinking and before the content is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orcaserve.handler.openai.structured import FieldError

THINK_START, THINK_END = "<think>", "</think>"
STYLES = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningStyle:
    """How a model's answer opens its thinking; `can_skip` says whether the template answers
    without thinking when asked (`enable_thinking: false`)."""

    name: str  # one of STYLES
    starts_inside: bool  # the prompt has opened the thinking (deepseek_r1)
    can_skip: bool = False


def _generation_suffix(tokenizer: Any, **kwargs: Any) -> str:
    """What the template appends for the assistant's turn (the generation prompt)."""
    messages = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else with_prompt


def reasoning_style(setting: str | None, tokenizer: Any) -> ReasoningStyle | None:
    """The model's style: `setting` is qwen3, deepseek_r1, none (or None: off) or auto (from the
    chat template: one that opens `<think>` in its generation prompt is deepseek_r1, one that
    otherwise writes the think tags is qwen3, any other is off); raises ValueError for another."""
    if setting in (None, "none"):
        return None
    if setting not in (*STYLES, "auto"):
        raise ValueError(f"reasoning_parser must be one of {[*STYLES, 'auto', 'none']}, got {setting!r}")
    template = getattr(tokenizer, "chat_template", None)
    opens = can_skip = False
    if isinstance(template, str) and template:
        try:
            opens = _generation_suffix(tokenizer).rstrip().endswith(THINK_START)
            can_skip = THINK_END in _generation_suffix(tokenizer, enable_thinking=False)
        except Exception:  # a template that needs more than one user turn: nothing known
            opens = can_skip = False
    if setting == "auto":
        if not isinstance(template, str) or THINK_END not in template:
            return None
        setting = "deepseek_r1" if opens else "qwen3"
    return ReasoningStyle(setting, setting == "deepseek_r1" or opens, can_skip and not opens)


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One answer's text pieces in, (thinking, content) pieces out. `feed` each piece, `finish`
    once at the end; the pieces joined equal `split` of the whole text."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self._state = "start"  # start -> thinking -> content
        self._held = ""  # text not yet known to be thinking or content
        self._think_ws = ""  # whitespace inside the thinking, released once more thinking follows
        self._thought = False  # some thinking went out (leading whitespace is dropped before)
        self._answered = False  # some content went out (leading whitespace is dropped before)

    def feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        self._held = ""
        thinking, content = "", ""
        if self._state == "start":
            lead = held.lstrip()
            if not lead or (THINK_START.startswith(lead) and lead != THINK_START):
                self._held = held  # nothing yet, or perhaps `<think>`
                return "", ""
            if lead.startswith(THINK_START):
                self._state, held = "thinking", lead[len(THINK_START) :]
            else:
                self._state = "thinking" if self.style.starts_inside else "content"
        if self._state == "thinking":
            end = held.find(THINK_END)
            if end < 0:
                keep = _partial(held, THINK_END)
                self._held = held[len(held) - keep :]
                return self._think(held[: len(held) - keep]), ""
            thinking = self._think(held[:end])
            self._state, held = "content", held[end + len(THINK_END) :]
        if self._state == "content":
            content = self._answer(held)
        return thinking, content

    def finish(self) -> tuple[str, str]:
        """What is left when the answer ends: held text goes where it stood."""
        held, self._held = self._held, ""
        if self._state == "start" and not self.style.starts_inside:
            return "", self._answer(held)
        if self._state == "content":
            return "", self._answer(held)
        return self._think(held), ""

    def _think(self, text: str) -> str:
        text = self._think_ws + text
        if not self._thought:
            text = text.lstrip()
        body = text.rstrip()
        self._think_ws = text[len(body) :]
        self._thought = self._thought or bool(body)
        return body

    def _answer(self, text: str) -> str:
        if not self._answered:
            text = text.lstrip()
            self._answered = bool(text)
        return text


def split(style: ReasoningStyle, text: str) -> tuple[str, str]:
    """A whole answer's (thinking, content)."""
    splitter = ReasoningSplitter(style)
    thinking, content = splitter.feed(text)
    more = splitter.finish()
    return thinking + more[0], content + more[1]


# Template arguments a request may not set: the renderer's own.
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "documents"})


def template_kwargs(value: Any) -> dict[str, Any] | None:
    """A request's `chat_template_kwargs` (vLLM's field, e.g. `{"enable_thinking": false}`),
    checked; raises FieldError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise FieldError(f"chat_template_kwargs must be an object, got {value!r}", "chat_template_kwargs")
    reserved = sorted(_RESERVED_KWARGS & set(value))
    if reserved:
        raise FieldError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    return dict(value)


def constrained_kwargs(style: ReasoningStyle | None, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The template arguments of a request whose answer is constrained (structured outputs, a
    forced tool call): the constraint holds from the first token, so the model must answer
    without thinking. A qwen3-style template is asked to skip it; raises ValueError where it
    cannot be skipped (deepseek_r1) or the request asks for thinking."""
    if style is None:
        return kwargs
    if (kwargs or {}).get("enable_thinking") is True:
        raise ValueError("a constrained answer (structured outputs, a forced tool call) cannot follow thinking")
    if not style.can_skip:
        raise ValueError(
            f"this model always thinks first ({style.name}); structured outputs and forced tool calls "
            "would constrain its thinking and are refused"
        )
    return {**(kwargs or {}), "enable_thinking": False}

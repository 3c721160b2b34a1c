"""The thinking split from the answer (handler/reasoning.py): every split of the text into pieces,
streamed and whole, both styles, and the style chosen from a chat template."""

from __future__ import annotations

import copy
import itertools

import pytest
from thinking_models import QWEN3_TEMPLATE, R1_TEMPLATE

from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.openai import protocol as P
from orcaserve.handler.openai import reasoning_content as RC
from orcaserve.handler.reasoning import ReasoningSplitter, ReasoningStyle, reasoning_style, split

QWEN3 = ReasoningStyle("qwen3", starts_inside=False, can_skip=True)
R1 = ReasoningStyle("deepseek_r1", starts_inside=True)


def pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(style: ReasoningStyle, parts: list[str]) -> tuple[str, str]:
    splitter, thinking, content = ReasoningSplitter(style), [], []
    for part in parts:
        t, c = splitter.feed(part)
        thinking.append(t)
        content.append(c)
    t, c = splitter.finish()
    return "".join(thinking) + t, "".join(content) + c


CASES = [
    # (style, text, thinking, content)
    (QWEN3, "<think>\nLet me see: 2 < 3.\n</think>\n\nYes, <b>2</b>.", "Let me see: 2 < 3.", "Yes, <b>2</b>."),
    (QWEN3, "No thinking </think> here.", "", "No thinking </think> here."),
    (QWEN3, "<thin", "", "<thin"),  # cut inside the tag: it never was one
    (QWEN3, "<think>cut in the middle", "cut in the middle", ""),
    (R1, "x < y, so </thin k</think>Answer", "x < y, so </thin k", "Answer"),
    (R1, "<think>\nhmm\n</think>\n\nA", "hmm", "A"),
    (R1, "thinking cut by a length </th", "thinking cut by a length </th", ""),
]


@pytest.mark.parametrize("style, text, thinking, content", CASES)
def test_every_split_in_two_or_three_pieces(style, text, thinking, content):
    assert split(style, text) == (thinking, content)
    n = len(text)
    for k in (1, 2):
        for cuts in itertools.combinations(range(1, n), k):
            assert streamed(style, pieces(text, cuts)) == (thinking, content), cuts


@pytest.mark.parametrize("style, text, thinking, content", CASES)
def test_one_character_at_a_time_never_leaks(style, text, thinking, content):
    splitter, seen_thinking, seen_content = ReasoningSplitter(style), "", ""
    for ch in text:
        t, c = splitter.feed(ch)
        seen_thinking, seen_content = seen_thinking + t, seen_content + c
        # Nothing released is ever taken back: each channel is a prefix of its final text.
        assert thinking.startswith(seen_thinking) and content.startswith(seen_content)
    t, c = splitter.finish()
    assert (seen_thinking + t, seen_content + c) == (thinking, content)


def tokenizer_with(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_style_from_the_chat_template(tokenizer):
    assert reasoning_style("auto", tokenizer) is None  # SmolLM2: no think tags
    qwen3 = reasoning_style("auto", tokenizer_with(tokenizer, QWEN3_TEMPLATE))
    assert qwen3 == ReasoningStyle("qwen3", starts_inside=False, can_skip=True)
    r1 = reasoning_style("auto", tokenizer_with(tokenizer, R1_TEMPLATE))
    assert r1 == ReasoningStyle("deepseek_r1", starts_inside=True, can_skip=False)
    assert reasoning_style("none", tokenizer_with(tokenizer, QWEN3_TEMPLATE)) is None
    assert reasoning_style("deepseek_r1", tokenizer).starts_inside
    with pytest.raises(ValueError, match="reasoning_parser"):
        HandlerConfig.from_dict({"reasoning_parser": "r1"})
    assert HandlerConfig.from_dict({"reasoning_parser": "none"}).reasoning_parser is None


def chat(**extra) -> P.ParsedRequest:
    return P.parse_request({"messages": [{"role": "user", "content": "hi"}], **extra}, P.CHAT)


def test_template_kwargs_and_constrained_answers():
    assert chat(chat_template_kwargs={"enable_thinking": False}).prompt.template_kwargs == {"enable_thinking": False}
    for bad in ({"tools": []}, "x", {"add_generation_prompt": False}):
        with pytest.raises(P.ProtocolError) as e:
            chat(chat_template_kwargs=bad)
        assert e.value.param == "chat_template_kwargs"
    fmt = {"response_format": {"type": "json_object"}}
    # Unchanged without a parser; qwen3 answers a constrained request without thinking.
    assert RC.prepare(None, chat(**fmt)).prompt.template_kwargs is None
    assert RC.prepare(QWEN3, chat(**fmt)).prompt.template_kwargs == {"enable_thinking": False}
    assert RC.prepare(QWEN3, chat()).prompt.template_kwargs is None
    for style, extra in ((R1, {}), (QWEN3, {"chat_template_kwargs": {"enable_thinking": True}})):
        with pytest.raises(P.ProtocolError) as e:
            RC.prepare(style, chat(**fmt, **extra))
        assert e.value.status == 400 and e.value.param == "response_format"

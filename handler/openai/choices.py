"""A request's `n` choices in its answer: outputs grouped by choice, and the request's usage."""

from __future__ import annotations

from collections.abc import Iterable

from orcaserve.scheduler.core.outputs import RequestOutput


def by_choice(outputs: list[RequestOutput]) -> list[tuple[int, list[RequestOutput]]]:
    """A frame's outputs grouped by choice, each choice's in order; a stream interleaves choices
    by `index`, as OpenAI's does."""
    groups: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        groups.setdefault(out.index, []).append(out)
    return list(groups.items())


def usage(finals: Iterable[RequestOutput]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a request from its choices' final outputs:
    the prompt counted once (the choices share it), the choices' tokens summed, the cached tokens
    those the first choice found in the cache."""
    ordered = sorted(finals, key=lambda out: out.index)
    completion = sum(out.completion_tokens for out in ordered)
    return ordered[0].prompt_tokens, completion, ordered[0].num_cached_tokens

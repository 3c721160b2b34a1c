"""Proposers: where a request's proposed next tokens come from, one object per method in a table
(docs/speculative-decoding.md "Prompt lookup", "Draft model").

A proposer is asked, for all the step's speculating rows at once (`propose_batch`: a draft model
runs one forward per proposal position for all of them), for up to `k` tokens that may follow each
request's tokens so far; it keeps what it learned about a request between steps and forgets it
when told (`drop`: the request finished or was preempted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.draft import DraftProposer
from orcaserve.scheduler.spec.policy import match_kind
from orcaserve.scheduler.spec.target import Target


class LookupSettings(Protocol):
    """What a proposer reads of the `speculative` setting (`SpeculativeConfig`, which checks
    `method` against this module's table)."""

    @property
    def prompt_lookup_min(self) -> int: ...

    @property
    def prompt_lookup_max(self) -> int: ...


class Proposer(Protocol):
    def propose_batch(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k proposals for each (request, k), in order ([] : none)."""
        ...

    def kinds(self, reqs: Sequence[Request]) -> dict[str, int]:
        """The kind of proposal each request would get this step, known before proposing (the
        policy keeps a request's acceptance per kind, policy.py); a request left out has none."""
        ...

    def distributions(self) -> dict[str, torch.Tensor]:
        """The proposer's distribution [K, V] at each proposal of the last `propose_batch`, by
        request, where it drew them from one (a draft model's sampled rows: the general rejection
        rule checks them, verify.py); a request left out proposed point masses."""
        ...

    def drop(self, request_id: str) -> None: ...


LONGEST_MATCH = 32  # a match is measured up to this many tokens (its kind needs no more)


class _Index:
    """One request's n-grams: for each n, the n-gram -> the position of its last token, the latest
    occurrence; `done`: n-grams ending before this position are in."""

    __slots__ = ("done", "maps", "found")

    def __init__(self, sizes: range) -> None:
        self.done = 0
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.found: tuple[int, int, int] = (-1, -1, 0)  # tokens looked up, the hit, its match length


class NgramProposer:
    """Prompt lookup (Saxena 2023; vLLM's and llama.cpp's n-gram mode): the longest suffix of the
    request's tokens, from `prompt_lookup_max` down to `prompt_lookup_min` tokens, that occurred
    before, and the tokens that followed its latest occurrence.

    The n-grams are indexed as tokens arrive (a dict per n, O(1) per token), so a step costs a
    few lookups whatever the length of the request. A match whose continuation runs into the
    suffix itself continues the repetition it found (a period-p loop proposes k tokens, not p).
    """

    def __init__(self, config: LookupSettings) -> None:
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self._index: dict[str, _Index] = {}

    def lookup(self, request_id: str, tokens: Sequence[int]) -> tuple[int, int]:
        """The latest earlier occurrence of the longest suffix looked up (the position of its last
        token, -1: none) and how many tokens before the end agree with it, measured backwards past
        `prompt_lookup_max` up to LONGEST_MATCH: the match length, which tells how far the request
        is into a copied run (the proposal's kind for the policy, `kinds`)."""
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _Index(self.sizes)
        total = len(tokens)
        if index.found[0] == total:
            return index.found[1], index.found[2]
        # Index every n-gram ending before the last token (the suffix must not find itself).
        maps = index.maps
        for end in range(index.done, total - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    maps[n][tuple(tokens[end + 1 - n : end + 1])] = end
        index.done = max(index.done, total - 1)
        hit, length = -1, 0
        for n in reversed(self.sizes):
            if total < n:
                continue
            at = maps[n].get(tuple(tokens[total - n :]))
            if at is not None:
                hit, length = at, n
                while length < LONGEST_MATCH and at - length >= 0 and tokens[at - length] == tokens[total - 1 - length]:
                    length += 1
                break
        index.found = (total, hit, length)
        return hit, length

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        hit, _ = self.lookup(request_id, tokens)
        if hit < 0:
            return []
        total = len(tokens)
        out: list[int] = []
        for j in range(hit + 1, hit + 1 + k):  # positions past the end repeat the proposal itself
            out.append(tokens[j] if j < total else out[j - total])
        return out

    def kinds(self, reqs: Sequence[Request]) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for req in reqs:
            hit, length = self.lookup(req.request_id, req.all_token_ids)
            if hit >= 0:
                kinds[req.request_id] = match_kind(length)
        return kinds

    def propose_batch(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose(req.request_id, req.all_token_ids, k) for req, k in rows]

    def distributions(self) -> dict[str, torch.Tensor]:
        """A lookup's proposal is a point mass."""
        return {}

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, Target], Proposer]] = {
    "ngram": lambda config, target: NgramProposer(config),
    "draft": DraftProposer,
}

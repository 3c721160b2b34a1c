"""Checking proposals against the target model (docs/speculative-decoding.md "Exactness").

Two forms of one rule. `accepted_length` is the engine's for prompt lookup, whose proposal is one
token (the draft distribution is a point mass): the target samples every checked position as it
would without speculation (greedy: the argmax; sampling: the request's own sampler and random
stream), and a proposal is accepted while it equals the target's sample. For a point mass q at d,
Leviathan et al. (2023) accept d with probability min(1, p(d) / q(d)) = p(d) and otherwise sample
from norm(max(0, p - q)), which is p without d: exactly the law of "sample t ~ p; accept iff t = d,
else emit t". Sampling t first makes the emitted tokens the very tokens speculation off would
emit, token for token, greedy or seeded.

`rejection_sample` is the general rule (Leviathan et al. 2023, Chen et al. 2023) for a draft
with a distribution, vectorised over many rows: a draft model's proposals on a sampled row carry
the draft's distributions (`DraftRun`), and the sampler checks them with it (`check_drafted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from orcaserve.scheduler.core.request import Request


@dataclass(frozen=True)
class DraftRun:
    """A sampled row's proposals from a draft model and the draft's distribution at each: the
    request's sampling settings applied to the draft's logits (`processed_probs`), q [K, V]."""

    tokens: list[int]
    probs: torch.Tensor


def accepted_length(sampled: Sequence[int], proposed: Sequence[int]) -> int:
    """How many leading proposals equal the target's samples at their positions (`sampled[j]` is
    the target's token after proposal j - 1; `len(sampled) == len(proposed) + 1`)."""
    a = 0
    for t, d in zip(sampled, proposed):
        if t != d:
            break
        a += 1
    return a


def rejection_sample(
    target_probs: torch.Tensor,  # [N, K + 1, V] the target's distribution at each checked position
    draft_tokens: torch.Tensor,  # [N, K] int64 the proposals
    draft_probs: torch.Tensor | None = None,  # [N, K, V] the draft's distributions; None: point masses
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens emitted [N, K + 1] (-1 past each row's end) and their number [N] (1 to K + 1).

    Proposal j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) while all before it were;
    at the first rejection a token is drawn from norm(max(0, p_j - q_j)) and the row ends; when all
    K are accepted a bonus token is drawn from p_K."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    p_d = target_probs[:, :k].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [N, K]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        q = torch.zeros(n, k, vocab, dtype=target_probs.dtype, device=dev).scatter_(2, draft_tokens[:, :, None], 1.0)
    else:
        q_d = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)
        q = draft_probs
    u = torch.rand(n, k, generator=generator, dtype=torch.float64, device=dev)  # [N, K]
    ratio = (p_d.double() / q_d.double().clamp_min(1e-30)).clamp(max=1.0)
    accepted = (u < ratio).int().cumprod(1)  # [N, K] 1 while every proposal so far was accepted
    num_accepted = accepted.sum(1)  # [N]
    # Where a row ends: the residual at its first rejection, or p_K after K acceptances.
    residual = (target_probs[:, :k] - q).clamp_min(0.0)  # [N, K, V]
    last = torch.cat([residual, target_probs[:, k:]], dim=1)  # [N, K + 1, V]
    dist = last[torch.arange(n, device=dev), num_accepted]  # [N, V]
    # A residual of zero mass (p == q): any proposal is accepted there, so it is used only where
    # rounding made p(d) < q(d) and u fell above; then p without d (a rejection never emits d).
    has_mass = dist.sum(1, keepdim=True) > 0  # [N, 1]
    if not bool(has_mass.all()):
        fallback = target_probs[torch.arange(n, device=dev), num_accepted].clone()  # [N, V]
        rejected = num_accepted < k
        d = draft_tokens[torch.arange(n, device=dev), num_accepted.clamp(max=k - 1)]  # [N]
        fallback[rejected, d[rejected]] = 0.0
        dist = torch.where(has_mass, dist, fallback)
    noise = torch.empty_like(dist, dtype=torch.float64).exponential_(generator=generator)
    final = (dist.double() / noise).argmax(1)  # [N] the exponential race draws from norm(dist)
    cols = torch.arange(k1, device=dev)[None]  # [1, K + 1]
    out = torch.full((n, k1), -1, dtype=torch.long, device=dev)
    out[:, :k] = torch.where(cols[:, :k] < num_accepted[:, None], draft_tokens, -1)
    out[torch.arange(n, device=dev), num_accepted] = final
    return out, num_accepted + 1


def check_drafted(
    probs: torch.Tensor,  # [S, V] the target's processed probabilities of a step's sampling rows
    reqs: Sequence[Request],  # [S] a drafted request on 1 + K consecutive rows
    drafted: Mapping[str, DraftRun],
    sampled: torch.Tensor,  # [S] written over on the drafted rows
) -> None:
    """Each drafted request's run checked by `rejection_sample` with its own random stream (a
    seeded request draws from its generator only here and in its draft, so it repeats itself):
    its rows get the accepted proposals, then the drawn token, repeated to the run's end (the
    rows past it are dropped by `SpecDecoding.accept`, which finds the run by comparing)."""
    done: set[str] = set()
    for i, req in enumerate(reqs):
        rid = req.request_id
        run = drafted.get(rid)
        if run is None or rid in done:
            continue
        done.add(rid)
        k = len(run.tokens)
        drafts = torch.tensor([run.tokens], dtype=torch.long, device=probs.device)
        out, emitted = rejection_sample(probs[None, i : i + k + 1], drafts, run.probs[None], req.generator)
        n = int(emitted[0])
        row = out[0]
        row[n:] = row[n - 1]
        sampled[i : i + k + 1] = row

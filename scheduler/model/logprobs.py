"""Log-probabilities of sampled tokens and of the most likely alternatives (OpenAI's `logprobs`),
computed from a step's logits into `TokenLogprob`s (scheduler/core/token_logprob.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.token_logprob import TokenLogprob

_CHUNK = 64


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` for [W, V] rows, in a fifth to a third of its time on a step's logits
    (docs/performance-log.md, "Log-probabilities and echo: what they cost").

    The k largest entries lie in the k chunks of `_CHUNK` with the largest maxima: a chunk's
    maximum reaches the k-th largest value only if the chunk holds one of the k, so at most k
    chunks do. Only those k * _CHUNK candidates are ranked; a max per chunk reads the row once."""
    rows, vocab = x.shape
    if vocab % _CHUNK or vocab // _CHUNK < k:
        return x.topk(k, dim=-1)
    chunks = x.reshape(rows, vocab // _CHUNK, _CHUNK)  # [W, V / C, C]
    best = chunks.amax(-1).topk(k, dim=-1).indices  # [W, k] the chunks to look in
    candidates = chunks.gather(1, best[:, :, None].expand(-1, -1, _CHUNK)).reshape(rows, k * _CHUNK)
    values, pos = candidates.topk(k, dim=-1)  # [W, k]
    ids = best.gather(1, torch.div(pos, _CHUNK, rounding_mode="floor")) * _CHUNK + pos % _CHUNK
    return values, ids


def token_logprobs(
    logits: torch.Tensor,  # [S, V] the model's logits of the sampling rows, untouched by the sampler
    reqs: Sequence[Request],  # [S]
    tokens: Sequence[int],  # [S] what the sampler picked
) -> list[TokenLogprob | None]:
    """One entry per row: None for requests that did not ask for log-probabilities.

    Only the rows that asked are read (a [32, 49152] batch costs a few ms)."""
    out: list[TokenLogprob | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not want:
        return out
    x = logits if len(want) == len(reqs) else logits.index_select(0, torch.tensor(want, device=logits.device))
    lp = torch.log_softmax(x, dim=-1, dtype=torch.float32)  # [W, V]
    picked = torch.tensor([tokens[i] for i in want], device=logits.device)
    chosen = lp.gather(1, picked[:, None]).squeeze(1).tolist()  # [W]
    k = max(reqs[i].params.logprobs or 0 for i in want)
    top_ids: list[list[int]] = [[] for _ in want]
    top_lps: list[list[float]] = [[] for _ in want]
    if k:
        values, ids = top_k(lp, min(k, lp.shape[1]))  # [W, k], most likely first
        top_ids, top_lps = ids.tolist(), values.tolist()
    for j, i in enumerate(want):
        n = reqs[i].params.logprobs or 0
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_lps[j][:n])))
    return out

"""A sampled token's log-probability (OpenAI's `logprobs`): the type a request and its outputs
carry, below both the core and the model that computes it (scheduler/model/logprobs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability, and the `top` most likely tokens at its position
    (`SamplingParams.logprobs` of them, most likely first, as (token id, log-probability)).

    Both come from the model's own distribution, before penalties, temperature and top-k/p/min-p
    (vLLM's default, `raw_logprobs`): what the model thinks of a token, whatever the request
    then did to pick it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

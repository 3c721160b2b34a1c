"""A step's batch run on the device and read back later: the model and sampler over a batch
(with a failing request isolated), and what the engine keeps of it until its ids come back.

With asynchronous scheduling the engine launches step N+1 before it reads step N's ids; every
sampling request's next token is a placeholder until then (docs/host-overlap.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import torch

from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.core.token_logprob import TokenLogprob
from orcaserve.scheduler.model.grammar import Grammars
from orcaserve.scheduler.model.logprobs import token_logprobs
from orcaserve.scheduler.model.model_runner import ModelRunner
from orcaserve.scheduler.model.sampler import Sampler, plain_argmax

log = logging.getLogger(__name__)
_needs_host = attrgetter("needs_host")
_logprobs = attrgetter("logprobs")
Failures = list[tuple[Request, Exception]]


@dataclass(frozen=True)
class BatchModel:
    """What a batch runs on: the model runner and the cache's block tables, the sampler, and the
    grammars a constrained request's matcher starts from."""

    runner: ModelRunner
    kv: KVCacheManager
    sampler: Sampler
    grammars: Grammars


@dataclass
class Part:
    """Sampled rows of (part of) a batch: their requests, ids [S] on the device, logprobs if asked."""

    reqs: list[Request]
    tokens: torch.Tensor
    logprobs: list[TokenLogprob | None] | None


@dataclass
class Launched:
    """A step queued on the device: its sampling requests in row order, the ids [S] on the device,
    the call that waits for them on the host (`ModelRunner.to_host`), logprobs if any asked."""

    reqs: list[Request]
    tokens: torch.Tensor
    host_ids: Callable[[], list[int]]
    logprobs: list[TokenLogprob | None] | None

    @classmethod
    def of(cls, parts: list[Part], to_host: Callable[[torch.Tensor], Callable[[], list[int]]]) -> Launched:
        reqs = parts[0].reqs if len(parts) == 1 else [req for part in parts for req in part.reqs]
        tokens = parts[0].tokens if len(parts) == 1 else torch.cat([part.tokens for part in parts])  # [S]
        want = any(part.logprobs is not None for part in parts)
        logprobs = [lp for p in parts for lp in (p.logprobs or [None] * len(p.reqs))] if want else None
        return cls(reqs, tokens, to_host(tokens), logprobs)

    def add_placeholders(self, max_model_len: int) -> None:
        """Each request's next token is this step's row until `_collect` fills it; a request
        whose token reaches a length limit is not scheduled again meanwhile."""
        for row, req in enumerate(self.reqs):
            req.add_placeholder(row)
            n = len(req.all_token_ids)
            req.final_in_flight = n - len(req.prompt_token_ids) >= req.params.max_tokens or n >= max_model_len


def needs_host(reqs: list[Request]) -> bool:
    """Whether a row samples from host state its previous token changes (`SamplingParams.needs_host`)."""
    return any(map(_needs_host, reqs))  # (C-level passes: these run over every row of every step)


def run_batch(
    model: BatchModel, sched: SchedulerOutput, fault_hook: Callable[[SchedulerOutput], None] | None = None
) -> tuple[list[Part], Failures]:
    """Model and sampler over `sched`: the sampled parts of the batch, and (request, error)
    failures. `fault_hook` (a test's) sees the batch first; raising fails it.

    On a failure the batch is halved and each half re-run until the failing requests stand
    alone: re-running a step is safe (the scheduler has not advanced; K/V slots are rewritten
    with the same values), and a failure of one request costs its batch-mates a few extra
    forwards instead of their answers.
    """
    try:
        if fault_hook is not None:
            fault_hook(sched)
        sampling = sched.sampling
        if model.runner.argmax_head and not sched.drafted and all(map(plain_argmax, sampling)):
            # every row's token is its logits' argmax: taken in the lm_head, no logits made
            return [Part(sampling, model.runner.execute(sched, model.kv, argmax=True), None)], []
        logits: Any = model.runner.execute(sched, model.kv)
        if needs_host(sampling):  # (a constrained request is one) its matcher starts at its first token
            for req in sampling:
                if req.grammar is None and req.params.structured_outputs is not None:
                    req.grammar = model.grammars.state(req.params.structured_outputs, req.stop_token_ids)
        drafted = sched.drafted  # a draft model's proposals on sampled rows: the general rejection rule
        tokens = model.sampler.sample(logits, sampling, drafted) if drafted else model.sampler.sample(logits, sampling)
        logprobs = None
        if any(map(is_not, map(_logprobs, sampling), repeat(None))):  # asked for: they need the ids now
            logprobs = token_logprobs(logits, sampling, tokens.tolist())
        return [Part(sched.sampling, tokens, logprobs)], []
    except Exception as e:
        ids = list(sched.num_scheduled_tokens)
        if len(ids) == 1:
            log.error("request %s failed in the model run: %s: %s", ids[0], type(e).__name__, e)
            return [], [(sched.requests[ids[0]], e)]
        log.warning("a step of %d requests failed (%s: %s); re-running it in halves", len(ids), type(e).__name__, e)
        parts: list[Part] = []
        failed: Failures = []
        for half in (ids[: len(ids) // 2], ids[len(ids) // 2 :]):
            ok, bad = run_batch(model, sched.subset(half), fault_hook)
            parts += ok
            failed += bad
        return parts, failed

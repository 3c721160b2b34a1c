"""One batched sampler for all requests that sample in a step, each with its own parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.model.grammar import MaskBuffer, apply_grammars
from orcaserve.scheduler.spec.verify import DraftRun, check_drafted


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a sync: `torch.tensor(values, device=cuda)` copies from
    pageable memory and waits for the stream; a pinned copy is queued behind the step's work."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Each row's `logit_bias` added to its logits (ids checked against the vocabulary by
    `Engine.add_request`)."""
    for i, req in enumerate(reqs):
        bias = req.params.logit_bias
        if bias:
            ids = to_device(list(bias), torch.long, logits.device)
            logits[i].index_add_(0, ids, to_device(list(bias.values()), logits.dtype, logits.device))


def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Repetition (over prompt and output, HF semantics), presence and frequency (output only)."""
    vocab = logits.shape[1]
    for i, req in enumerate(reqs):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = to_device(sorted(set(req.all_token_ids)), torch.long, logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            # Counts by index_add, not bincount: bincount sizes its output from the ids' maximum,
            # which on a GPU is a sync. Whole numbers, so the same values.
            out = to_device([t for t in req.output_token_ids if t < vocab], torch.long, logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.index_add_(0, out, torch.ones(out.shape[0], dtype=logits.dtype, device=logits.device))  # [V]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(
    logits: torch.Tensor,  # [S, V] temperature-scaled
    top_k: list[int],  # per row; 0 = off
    top_p: list[float],  # per row; 1.0 = off
    min_p: list[float],  # per row; 0.0 = off
) -> torch.Tensor:
    """top-k, top-p and min-p per row; filtered entries become -inf. Shared with the baseline."""
    top_k = [k if 0 < k < logits.shape[1] else logits.shape[1] for k in top_k]
    dev = logits.device
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        floor = to_device(min_p, torch.float32, dev)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(-1, descending=True)  # [S, V]
        rank = torch.arange(logits.shape[1], device=dev)[None]
        drop = rank >= to_device(top_k, torch.long, dev)[:, None]
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # keep a token while the mass before it is below top_p; the top token always stays
        drop |= (cum - sorted_logits.softmax(-1)) >= to_device(top_p, torch.float32, dev)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def argmax_ops() -> dict[torch.dtype, Any]:
    """The C++ argmax per logits dtype, where the dispatch table has one (fp32, bf16)."""
    ops = {dt: dispatch.kernel("argmax_rows", dt) for dt in (torch.float32, torch.bfloat16)}
    return {dt: op for dt, op in ops.items() if op is not None}


def argmax_rows(x: torch.Tensor, ops: Mapping[torch.dtype, Any]) -> torch.Tensor:  # [S, V] -> [S] int64
    """`x.argmax(-1)`; a contiguous CPU batch of a dtype in `ops` goes through its C++ op
    (csrc/fused/argmax.cpp), the same indices at a tenth of ATen's time on [32, 49152] logits."""
    op = ops.get(x.dtype) if x.device.type == "cpu" and x.is_contiguous() and x.shape[1] > 0 else None
    return op(x) if op is not None else x.argmax(-1)


def plain_argmax(req: Request) -> bool:
    """Whether `Sampler.sample` takes the row's token as its logits' argmax as they are: greedy, no
    logit bias, penalty or grammar to apply first, no log-probabilities to report from the logits."""
    p = req.params
    return p.greedy and p.logprobs is None and not p.logit_bias and not req.needs_host and req.grammar is None


class Sampler:
    """Greedy rows take the argmax; the rest sample by the exponential race.

    argmax(p / E) with E ~ Exp(1) draws from p. A seeded request draws its E from its own
    generator, so its tokens do not depend on the other requests in the batch.

    On a GPU everything stays there: parameters go over in non-blocking pinned copies, and the
    sampled ids (`sample`) stay on the device, for the next step's inputs and the step's one
    device-to-host copy (`ModelRunner.to_host`).
    """

    def __init__(self) -> None:
        # Looked up at the first CPU batch: an engine on a GPU never loads the C++ CPU library for
        # it (docs/performance-log.md#2026-12-04-start-up-and-the-op-registrations-amd-epyc-zen-2-2-vcpus).
        self.argmax_ops: dict[torch.dtype, Any] | None = None
        self.masks = MaskBuffer()  # structured outputs' token masks (model/grammar.py)

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S]
        if x.device.type != "cpu":
            return x.argmax(-1)
        if self.argmax_ops is None:
            self.argmax_ops = argmax_ops()
        return argmax_rows(x, self.argmax_ops)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        return self.sample(logits, reqs).tolist()

    def sample(
        self,
        logits: torch.Tensor,  # [S, V]
        reqs: list[Request],  # [S]
        drafted: Mapping[str, DraftRun] | None = None,
    ) -> torch.Tensor:  # [S] int64, on the device
        """Each row's token. `drafted`: a sampled request's proposals of a draft model with the
        draft's distributions (its rows are the request's 1 + K consecutive rows): checked by
        the general rejection rule (docs/speculative-decoding.md "Exactness"), its rows then hold
        the accepted proposals and the token drawn where the run ends (and that token again past it)."""
        # logits [S, V], fp32 or the model's dtype: an all-greedy batch without penalties takes
        # their argmax as they are (widening a bf16 [32, 49152] batch costs 1-3 ms a step here)
        if not reqs:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        logits = self._adjust(logits, reqs)
        greedy = self._argmax(logits)
        if all(r.params.greedy for r in reqs):
            return greedy
        probs = sampling_probs(logits, reqs)  # [S, V]
        dev = probs.device
        checked = drafted or {}
        noise = torch.empty_like(probs)
        if dev.type == "cpu":
            for i, req in enumerate(reqs):
                if req.request_id in checked:  # drawn by the rejection rule below
                    noise[i].fill_(1.0)
                elif req.generator is not None:
                    noise[i].exponential_(generator=req.generator)
                else:
                    noise[i].exponential_()
        else:
            noise.exponential_()  # one launch for every row
            for i, req in enumerate(reqs):
                if req.generator is not None:  # a CPU generator: its numbers, drawn here, as on a CPU
                    row = torch.empty(probs.shape[1], dtype=probs.dtype, pin_memory=True)
                    noise[i].copy_(row.exponential_(generator=req.generator), non_blocking=True)
        sampled = self._argmax(probs / noise)
        if checked:
            check_drafted(probs, reqs, checked, sampled)
        is_greedy = to_device([r.params.greedy for r in reqs], torch.bool, dev)
        return torch.where(is_greedy, greedy, sampled)

    def _adjust(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Grammar masks, logit bias and penalties, on a copy where the engine reads the logits after."""
        biased = any(r.params.logit_bias for r in reqs)
        penalized = any(
            r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in reqs
        )
        constrained = any(r.grammar is not None for r in reqs)
        if biased or penalized or (constrained and any(r.params.logprobs is not None for r in reqs)):
            # a copy: the engine reports log-probabilities from the model's own logits
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        if constrained:  # first: a forbidden token stays -inf whatever bias or penalty follows.
            # In place when no copy was made: nothing reads the logits after the sampler then.
            apply_grammars(logits, [r.grammar for r in reqs], self.masks)
        if biased or penalized:
            _bias_and_penalize(logits, reqs)
        return logits


def _bias_and_penalize(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Each row's logit bias, then its penalties (as vLLM orders them), in place."""
    _apply_logit_bias(logits, reqs)
    _apply_penalties(logits, reqs)


def sampling_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:  # [S, V] -> [S, V] fp32
    """What a sampled row draws from, its logits already biased and penalized: the request's
    temperature (1 for a greedy row), then top-k, top-p and min-p, softmaxed."""
    logits = logits.float()
    temps = to_device([1.0 if r.params.greedy else r.params.temperature for r in reqs], torch.float32, logits.device)
    params = [r.params for r in reqs]
    return filter_logits(
        logits / temps[:, None], [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]
    ).softmax(-1)


def processed_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:  # [S, V] -> [S, V] fp32
    """The distribution the sampler draws each row's token from, for logits of another model (a
    draft's): the rows' logit bias and penalties on a copy, then `sampling_probs`."""
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    _bias_and_penalize(logits, reqs)
    return sampling_probs(logits, reqs)

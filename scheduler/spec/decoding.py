"""Speculative decoding inside the iteration-level step (docs/speculative-decoding.md).

Three calls from the engine's step, around the model run:

- `propose`, once the scheduler has built the step: a decode row that may speculate gets up to K
  proposed tokens appended to its tokens for this step; it then feeds 1 + K query tokens in the
  packed forward, like a prompt chunk, and samples at all K + 1 positions (the step's
  `spec` rows: `StepBuffers.prepare` asks for their logits). Proposals take the step's token
  budget left and never preempt: a row whose blocks cannot grow goes without.
- `accept`, once the sampled ids are on the host and before the scheduler advances: each row keeps
  its longest run of proposals the target agreed with (verify.py: its own samples, or for a draft
  model's sampled row the general rejection rule, which the sampler ran) plus the token the target
  drew after them; its tokens and computed count move back to what was accepted, so the K/V of
  rejected positions is overwritten later and never reaches the prefix cache. The step's rows
  become one row per emitted token, so postprocessing checks stops, limits and log-probabilities
  token by token, ending a request where speculation off would (at the same tokens, but for a draft
  model's sampled rows, whose tokens are other draws of the same distribution).
- `end_step`: a request's several outputs of the step become one (a streamed chunk may carry
  several tokens); the step's time goes to the cost model that decides when speculating pays.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.policy import SpecPolicy
from orcaserve.scheduler.spec.proposers import PROPOSERS
from orcaserve.scheduler.spec.stats import SpecStats
from orcaserve.scheduler.spec.target import Target
from orcaserve.scheduler.spec.verify import DraftRun, accepted_length

if TYPE_CHECKING:
    from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
    from orcaserve.scheduler.core.step_output import SchedulerOutput
    from orcaserve.scheduler.launch import Launched

log = logging.getLogger(__name__)


class SpecDecoding:
    """The engine's speculation: proposer, per-step decisions (policy.py) and counters."""

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        self.config = config
        self.proposer = PROPOSERS[config.method](config, target)  # a draft model loads here
        self.policy = SpecPolicy(config)
        self.stats = SpecStats(method=config.method)
        self.max_num_seqs = target.config.max_num_seqs
        self.max_model_len = target.max_model_len
        self.vocab_size = target.vocab_size
        self._tracked: dict[str, Request] = {}  # requests the proposer and the policy hold state for
        self._rng: dict[str, torch.Tensor] = {}  # a seeded sampled row's generator state before the step
        self._merge = False  # a request emitted several tokens this step
        self._kinds: dict[str, int] = {}  # the step's rows' kinds of proposal (`Proposer.kinds`)

    # ---- before the model runs ------------------------------------------------------------------
    def propose(self, sched: SchedulerOutput, budget: int, kv: KVCacheManager) -> None:
        """Give the step's eligible decode rows their proposals (see the module's docstring);
        `budget`: the tokens the scheduler left in the step (`Scheduler.budget_left`)."""
        self._forget_finished()
        for rid in sched.preempted:  # its draft state goes with its blocks (rebuilt when it speculates again)
            self.proposer.drop(rid)
        if sched.shape is None:  # the scheduler's cost model is off: the step's shape for this one
            sched.sampling = []
            sched.seal(True)
        rows_left = self.max_num_seqs - len(sched.sampling)
        nst = sched.num_scheduled_tokens
        candidates = [r for r in sched.sampling if nst[r.request_id] == 1 and _eligible(r)]
        if not candidates or budget <= 0 or rows_left <= 0:
            self.stats.steps_off += bool(candidates)
            return
        kinds = self.proposer.kinds(candidates)  # prompt lookup: the rows with a match, by its length
        self._kinds = kinds
        for req in candidates:  # the proposer now holds state for each: dropped when it finishes
            self._tracked[req.request_id] = req
        self.stats.unmatched_rows += sum(r.request_id not in kinds for r in candidates)
        candidates = [r for r in candidates if r.request_id in kinds]
        rows: list[tuple[Request, int]] = []  # the rows asked for proposals, each with its K
        for req, k in self.policy.plan(sched, candidates, kinds):
            out_left = req.params.max_tokens - len(req.output_token_ids) - 1  # emitted: at most k + 1
            k = min(k, budget, rows_left, out_left, self.max_model_len - req.num_tokens - 1)
            if req.params.num_speculative_tokens is not None:
                k = min(k, req.params.num_speculative_tokens)
            if k <= 0:
                continue
            rows.append((req, k))
            budget -= k
            rows_left -= k
        spec: dict[str, list[int]] = {}
        proposals = self._proposals(rows)
        probs = self.proposer.distributions() if proposals else {}  # a draft's sampled rows: their q
        for (req, _), drafts in zip(rows, proposals):
            rid = req.request_id
            if not drafts or not kv.allocate_slots(req, 1 + len(drafts)):
                continue  # no proposal, or no room: a plain decode
            req.all_token_ids.extend(drafts)  # for this step only: `accept` keeps what the target agreed with
            nst[rid] = 1 + len(drafts)
            spec[rid] = drafts
            if rid in probs:  # the general rule (verify.py), its draws from the request's stream
                sched.drafted[rid] = DraftRun(drafts, probs[rid])
            elif req.generator is not None and not req.params.greedy:
                self._rng[rid] = req.generator.get_state()
        if not spec:
            self.stats.steps_off += 1
            return
        self.stats.steps_on += 1
        sched.spec = spec
        # Who samples, again: a speculated row samples at each of its 1 + K positions, in order.
        sampling, sched.sampling = sched.sampling, []
        sched.seal(True)  # the step's shape (tokens, rows, context) as it now runs
        sched.sampling = [r for r in sampling for _ in range(1 + len(spec.get(r.request_id, ())))]

    def _proposals(self, rows: list[tuple[Request, int]]) -> list[list[int]]:
        """The proposer's answer for `rows`; if it raises (a draft model's forward), this step
        goes without proposals (its rows decode plainly, counted) and their proposer state is
        dropped, rebuilt when they speculate again: a failing proposer never fails a request."""
        if not rows:
            return []
        try:
            return self.proposer.propose_batch(rows)
        except Exception as e:
            log.warning(
                "speculation's %s proposer failed (%s: %s); the step decodes plainly",
                self.config.method,
                type(e).__name__,
                e,
            )
            self.stats.failed_steps += 1
            for req, _ in rows:
                self.proposer.drop(req.request_id)
            return []

    # ---- after the model ran ---------------------------------------------------------------
    def accept(self, sched: SchedulerOutput, launched: Launched) -> None:
        """Keep each speculated row's accepted run; `launched` then holds one row per emitted
        token (in order) for postprocessing, and the step's counts only the K/V to keep."""
        spec = sched.spec
        if not spec:
            return
        ids = launched.host_ids()
        lps = launched.logprobs
        reqs: list[Request] = []
        keep: list[int] = []  # rows of `ids` emitted
        i, rows = 0, launched.reqs
        while i < len(rows):
            req = rows[i]
            drafts = spec.get(req.request_id)
            if drafts is None:
                reqs.append(req)
                keep.append(i)
                i += 1
                continue
            k = len(drafts)
            a = accepted_length(ids[i : i + k + 1], drafts)
            reqs += [req] * (a + 1)
            keep += range(i, i + a + 1)
            # Back to the accepted tokens (the target's own at those positions): their K/V is kept,
            # the rejected positions' is written over by the next tokens.
            del req.all_token_ids[req.num_tokens - k + a :]
            sched.num_scheduled_tokens[req.request_id] = 1 + a
            self._merge |= a > 0
            self.stats.record(k, a)
            self.policy.observe(req.request_id, k, a, self._kinds.get(req.request_id, 0))
            state = self._rng.pop(req.request_id, None)
            if state is not None and a < k:
                self._rewind(req, state, a + 1)
            i += k + 1
        host = [ids[j] for j in keep]
        launched.reqs = reqs
        launched.host_ids = lambda: host
        launched.logprobs = [lps[j] for j in keep] if lps is not None else None
        self._rng.clear()

    def _rewind(self, req: Request, state: torch.Tensor, draws: int) -> None:
        """A seeded sampled row drew one noise row per checked position (`Sampler.sample`); only
        `draws` were emitted, so its generator goes back to where speculation off would have it."""
        assert req.generator is not None
        req.generator.set_state(state)
        row = torch.empty(self.vocab_size, dtype=torch.float32)
        for _ in range(draws):
            row.exponential_(generator=req.generator)

    def end_step(self, outputs: list[RequestOutput], sched: SchedulerOutput, seconds: float) -> list[RequestOutput]:
        """The step's outputs, one per request choice; the step's time to the cost model."""
        if sched.shape is not None:
            self.policy.observe_step(sched.shape, seconds)
        for rid in sched.spec:  # a request finished inside its run keeps no proposals
            req = sched.requests[rid]
            if req.status is RequestStatus.FINISHED:
                del req.all_token_ids[req.num_prompt_tokens + len(req.output_token_ids) :]
        self._forget_finished()  # in the step they finish in: an idle engine holds no request's state
        if not self._merge:
            return outputs
        self._merge = False
        return merge_outputs(outputs)

    def _forget_finished(self) -> None:
        done = [rid for rid, r in self._tracked.items() if r.status is RequestStatus.FINISHED]
        for rid in done:
            del self._tracked[rid]
            self.proposer.drop(rid)
            self.policy.drop(rid)


def _eligible(req: Request) -> bool:
    """Rows that speculate: not turned off by the request, and not sampling from host state its
    previous token changes (a grammar's mask, penalties over the tokens so far: the rows after a
    proposal would need the proposal's)."""
    return req.params.num_speculative_tokens != 0 and not req.needs_host


def merge_outputs(outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """Consecutive outputs of one request choice become one: its new tokens, text and
    log-probabilities joined, the rest the last one's (a final output stays final)."""
    merged: list[RequestOutput] = []
    where: dict[tuple[str, int], int] = {}
    for out in outputs:
        key = (out.request_id, out.index)
        at = where.get(key)
        if at is None:
            where[key] = len(merged)
            merged.append(out)
            continue
        first = merged[at]
        # `out` is this step's, built by postprocessing and read by no one yet: joined in place
        # (a `dataclasses.replace` of its 18 fields cost more than the rest of the merge).
        if first.new_logprobs is not None or out.new_logprobs is not None:
            out.new_logprobs = (first.new_logprobs or []) + (out.new_logprobs or [])
        out.new_token_ids = first.new_token_ids + out.new_token_ids
        out.new_text = first.new_text + out.new_text
        if first.prompt_token_ids is not None:
            out.prompt_token_ids = first.prompt_token_ids
        if first.prompt_logprobs is not None:
            out.prompt_logprobs = first.prompt_logprobs
        merged[at] = out
    return merged

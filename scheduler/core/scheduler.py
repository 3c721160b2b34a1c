"""ORCA iteration-level scheduling under a token budget, with preemption by recomputation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run and how many of their tokens each feeds."""

    # request -> tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # Requests whose scheduled tokens reach the end of their sequence: they sample a token this
    # step, in batch order. Decided here once; the runner and the engine read it.
    sampling: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def subset(self, request_ids: list[str]) -> SchedulerOutput:
        """The same step restricted to `request_ids` (to re-run part of a batch that failed)."""
        keep = set(request_ids)
        return SchedulerOutput(
            num_scheduled_tokens={r: n for r, n in self.num_scheduled_tokens.items() if r in keep},
            requests={r: req for r, req in self.requests.items() if r in keep},
            sampling=[req for req in self.sampling if req.request_id in keep],
        )


class Scheduler:
    """Chooses the batch of every step; the engine thread is its only caller.

    Each step: running decodes first (one token each, so new arrivals never stall them), then
    running requests that are still catching up (chunked prefill, recomputation), then waiting
    requests in policy order, until `max_num_batched_tokens` or `max_num_seqs` is reached. A long
    prompt takes what budget is left and continues next step. When the KV pool is empty the newest
    (or, under the priority policy, the lowest-priority) running request is preempted: its blocks
    are freed and it is recomputed later from its prompt and the tokens it already produced. With
    prefix caching, a request is admitted (and readmitted) after the longest cached prefix of its
    tokens; freed blocks stay cached until evicted, so a readmission often finds its own.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = policy == "priority"
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.by_priority)
        self.running: dict[str, Request] = {}  # in admission order; O(1) removal
        self.num_preemptions = 0
        # Prefix cache, in prompt tokens at first admission (readmissions after preemption would
        # count a request's own blocks as hits): tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queue maintenance -------------------------------------------------------------------
    def _key(self, req: Request) -> tuple[int, int]:
        return req.sort_key(self.by_priority)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def finish_request(self, req: Request, reason: str) -> None:
        """Remove a request for good and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            del self.running[req.request_id]
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req, front=True)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        def admit(req: Request, n: int) -> None:
            nonlocal budget
            out.num_scheduled_tokens[req.request_id] = n
            out.requests[req.request_id] = req
            budget -= n

        decodes = [r for r in self.running.values() if r.num_tokens - r.num_computed_tokens == 1]
        catching_up = sorted(
            (r for r in self.running.values() if r.num_tokens - r.num_computed_tokens > 1), key=self._key
        )
        for req in decodes + catching_up:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = max(self.running.values(), key=self._key)  # newest, or lowest priority
                refund = out.num_scheduled_tokens.pop(victim.request_id, 0)
                out.requests.pop(victim.request_id, None)
                budget += refund
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                admit(req, n)

        # Admitting new work right after a preemption would only evict it again.
        if not out.preempted:
            while budget > 0 and len(self.running) < self.max_num_seqs and (head := self.waiting.peek()) is not None:
                req = head
                # A waiting request holds no blocks (new, or preempted): start it, or restart it,
                # after the longest cached prefix of its tokens.
                hits = self.kv.find_cached_prefix(req)
                num_cached = len(hits) * self.kv.block_size
                n = min(req.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(req, n, hits):
                    break
                self.waiting.pop()
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = time.time()
                    req.num_cached_tokens = num_cached
                    if self.kv.enable_prefix_caching:
                        self.prefix_cache_queries += req.num_prompt_tokens
                        self.prefix_cache_hits += num_cached
                self.running[req.request_id] = req
                admit(req, n)
        for rid, n in out.num_scheduled_tokens.items():
            req = out.requests[rid]
            if req.num_computed_tokens + n == req.num_tokens:
                out.sampling.append(req)
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by the tokens it computed this step, and offer the
        blocks that step filled to the prefix cache (a request that failed the step holds none)."""
        for rid, n in out.num_scheduled_tokens.items():
            req = out.requests[rid]
            req.num_computed_tokens += n
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)

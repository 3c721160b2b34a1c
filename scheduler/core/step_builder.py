"""The step being built: the budget each row takes, running requests continued, waiting ones
admitted, and preemption by recomputation while the KV pool is short.

`Scheduler` (scheduler.py) is built on `StepBuilder`: the state is the scheduler's, declared
and initialised there; this part holds what the policies (scheduler.py's own, fair_step.py,
slo_budget.py) call to fill a step's batch, one row at a time.
"""

from __future__ import annotations

import time

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.fair_step import release_suspended
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import TenantQueues, WaitingQueue
from orcaserve.scheduler.core.slo_budget import is_untargeted_prompt
from orcaserve.scheduler.core.step_output import SchedulerOutput


class StepBuilder:
    """Rows given to the step being built, taken back, admitted and preempted (`Scheduler`'s)."""

    # The scheduler's state this part reads and writes (set in `Scheduler.__init__`).
    kv: KVCacheManager
    max_num_seqs: int
    fair: bool
    shares: TenantShares
    waiting: WaitingQueue | TenantQueues
    running: dict[str, Request]
    suspended: dict[str, Request]
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    _step_index: int
    _budget: int
    _pending: dict[str | None, float]
    _charges: dict[str, float]
    _untargeted_left: int | None
    _untargeted: dict[str, int]

    def victim_key(self, req: Request) -> tuple[float, bool, int, int]:
        raise NotImplementedError  # the policy's (Scheduler.victim_key)

    def limit_step(self, budget: int, untargeted_prompt: int | None) -> None:
        """Before the step is filled: at most `budget` tokens in all, of which rows computing the
        prompt of requests without a latency target take at most `untargeted_prompt` (None: no
        limit of their own; slo_budget.py)."""
        self._budget = budget
        self._untargeted_left = untargeted_prompt
        self._untargeted.clear()

    def _can_admit(self) -> bool:
        return self._budget > 0 and len(self.running) < self.max_num_seqs

    def _give(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.num_scheduled_tokens[req.request_id] = n
        out.requests[req.request_id] = req
        self._budget -= n
        if self._untargeted_left is not None and is_untargeted_prompt(req):
            self._untargeted_left -= n
            self._untargeted[req.request_id] = n
        if self.fair:
            tenant = self.shares.get(req.tenant)
            charge = self.shares.value(tenant, *self.shares.tokens(req, n))
            self._charges[req.request_id] = charge
            self._pending[req.tenant] = self._pending.get(req.tenant, 0.0) + charge

    def take_back(self, out: SchedulerOutput, req: Request) -> None:
        self._budget += out.num_scheduled_tokens.pop(req.request_id, 0)
        if self._untargeted_left is not None:
            self._untargeted_left += self._untargeted.pop(req.request_id, 0)
        out.requests.pop(req.request_id, None)
        charge = self._charges.pop(req.request_id, 0.0)
        if charge:
            self._pending[req.tenant] -= charge

    def room_for(self, req: Request) -> int:
        """Tokens the step's limits leave `req` (its budget, and the untargeted rows' share)."""
        return self._room(req, None)

    def _room(self, req: Request, limit: int | None) -> int:
        room = self._budget if limit is None else min(self._budget, limit)
        if self._untargeted_left is not None and is_untargeted_prompt(req):
            room = min(room, self._untargeted_left)
        return room

    def continue_running(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> None:
        """Give a running request its next tokens (at most `limit`), preempting while the KV pool
        is short."""
        if self._budget <= 0 or req.status != RequestStatus.RUNNING:
            return  # out of budget, or preempted earlier in this step
        n = min(req.num_tokens - req.num_computed_tokens, self._room(req, limit))
        if n <= 0:
            return  # the step's latency plan leaves this row no tokens
        while not self.kv.allocate_slots(req, n):
            if self.suspended and release_suspended(self, out):
                continue  # suspended requests give their blocks back before anyone running
            victim = max(self.running.values(), key=self.victim_key)
            self.take_back(out, victim)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return
        self._give(out, req, n)

    def start_waiting(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> bool:
        """Admit the waiting `req` (the head of its queue) with at most `limit` tokens, or return
        False, taking nothing, when the KV pool is short even after suspended requests gave their
        blocks back. A new or preempted request holds no blocks: it starts, or restarts, after the
        longest cached prefix of its tokens. A suspended one resumes with its blocks, where it
        stopped."""
        hits = [] if req.suspended else self.kv.find_cached_prefix(req)
        num_cached = req.num_computed_tokens if req.suspended else len(hits) * self.kv.block_size
        n = min(req.num_tokens - num_cached, self._room(req, limit))
        if n <= 0:
            return False
        while not self.kv.allocate_slots(req, n, hits):
            if not (self.suspended and release_suspended(self, out, keep=req)):
                return False
        if isinstance(self.waiting, TenantQueues):
            self.waiting.pop_tenant(req.tenant)
        else:
            self.waiting.pop()
        if req.suspended:
            del self.suspended[req.request_id]
            req.suspended = False
        req.num_computed_tokens = num_cached
        req.admitted_step = self._step_index
        req.status = RequestStatus.RUNNING
        if req.times.first_scheduled is None:
            req.times.first_scheduled = time.time()
            req.num_cached_tokens = num_cached
            req.prompt_charged = num_cached  # prefix-cache hits are not charged (docs/engine.md)
            if self.kv.enable_prefix_caching:
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += num_cached
        self.running[req.request_id] = req
        self.shares.admitted(req)
        self._give(out, req, n)
        return True

    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.shares.preempted(req)
        self.waiting.push(req, front=True)

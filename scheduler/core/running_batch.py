"""The running requests, the suspended ones, and the step being built from them: the budget each
row takes, running requests continued, waiting ones admitted, seats handed over, and preemption
by recomputation while the KV pool is short.

`RunningBatch` is the `StepBuilder` (policy.py) the scheduler hands its policy: the policy says
which request goes next, the batch does the bookkeeping and keeps the KV blocks, the tenants'
counts and the waiting queue in step with it.
"""

from __future__ import annotations

import time

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.policy import SchedulingPolicy
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.slo_budget import is_untargeted_prompt
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.lora.slots import LoraSlots, LoraWait


class RunningBatch:
    """Rows given to the step being built, taken back, admitted, suspended and preempted."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        shares: TenantShares,
        max_num_seqs: int,
        max_suspended: int,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.kv = kv
        self.policy = policy  # whose queue admits and takes back, and whose victim order preempts
        self.shares = shares
        self.max_num_seqs = max_num_seqs
        self.running: dict[str, Request] = {}  # in admission order; O(1) removal
        # Requests that handed their seat over and keep their blocks, oldest first; at most
        # `max_suspended` (blocks held idle), and the first to give their blocks back.
        self.suspended: dict[str, Request] = {}
        self.max_suspended = max_suspended
        self.num_preemptions = 0
        self.num_suspensions = 0
        # Prefix cache, in prompt tokens at first admission (readmissions after preemption would
        # count a request's own blocks as hits): tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.step_index = 0  # steps begun: a request admitted in this one is never suspended in it
        # The step being built: tokens left; the prompt tokens untargeted rows may still take in
        # it (None: no limit) and those each took.
        self._budget = 0
        self._untargeted_left: int | None = None
        self._untargeted: dict[str, int] = {}
        self._observer = policy.observer
        # The LoRA adapters stacked for the steps (lora/slots.py): a request of an adapter is
        # admitted only once its adapter holds a slot, and no running request's adapter loses one.
        self.lora_slots = lora_slots

    def begin(self, budget: int, untargeted_prompt: int | None) -> None:
        """A new step: at most `budget` tokens in all, of which rows computing the prompt of
        requests without a latency target take at most `untargeted_prompt` (None: no limit of
        their own; slo_budget.py)."""
        self.step_index += 1
        self._budget = budget
        self._untargeted_left = untargeted_prompt
        self._untargeted.clear()
        if self._observer is not None:
            self._observer.begin()

    def remove(self, req: Request) -> None:
        """`req` leaves for good while running or suspended (its blocks are the caller's to free)."""
        if req.status == RequestStatus.RUNNING:
            del self.running[req.request_id]
        elif req.suspended:
            del self.suspended[req.request_id]
            req.suspended = False

    # ---- the StepBuilder interface (policy.py) ---------------------------------------------------
    @property
    def budget_left(self) -> int:
        return self._budget

    def can_admit(self) -> bool:
        return self._budget > 0 and len(self.running) < self.max_num_seqs

    def can_suspend(self) -> bool:
        return len(self.suspended) < self.max_suspended

    def room_for(self, req: Request, limit: int | None = None) -> int:
        room = self._budget if limit is None else min(self._budget, limit)
        if self._untargeted_left is not None and is_untargeted_prompt(req):
            room = min(room, self._untargeted_left)
        return room

    def _give(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.num_scheduled_tokens[req.request_id] = n
        out.requests[req.request_id] = req
        self._budget -= n
        if self._untargeted_left is not None and is_untargeted_prompt(req):
            self._untargeted_left -= n
            self._untargeted[req.request_id] = n
        if self._observer is not None:
            self._observer.gave(req, n)

    def take_back(self, out: SchedulerOutput, req: Request) -> None:
        self._budget += out.num_scheduled_tokens.pop(req.request_id, 0)
        if self._untargeted_left is not None:
            self._untargeted_left += self._untargeted.pop(req.request_id, 0)
        if out.requests.pop(req.request_id, None) is not None and self._observer is not None:
            self._observer.took_back(req)

    def continue_decodes(self, out: SchedulerOutput, decodes: list[Request], sit_out: set[str]) -> None:
        """`continue_running` for each running decode not in `sit_out`, in order; the usual case
        inline (room in its last block): a decode is no prompt row, so the step's only limit for
        it is the budget."""
        nst, reqs, running = out.num_scheduled_tokens, out.requests, RequestStatus.RUNNING
        allocate, observer = self.kv.allocate_slots, self._observer
        budget = self._budget  # a local in the loop, the attribute around `continue_running`
        # (a request preempted in the loop is skipped; the others' blocks do not change meanwhile)
        for req, room in zip(decodes, self.kv.have_room(decodes)):
            rid = req.request_id
            if (sit_out and rid in sit_out) or req.status is not running:
                continue
            if budget <= 0:
                break  # and it only grows back through a preemption, which needs budget to happen
            if room or allocate(req, 1):
                nst[rid] = 1
                reqs[rid] = req
                budget -= 1
                if observer is not None:
                    observer.gave(req, 1)
            else:
                self._budget = budget
                self.continue_running(out, req)  # preempting while the KV pool is short
                budget = self._budget
        self._budget = budget

    def continue_running(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> None:
        if self._budget <= 0 or req.status != RequestStatus.RUNNING:
            return  # out of budget, or preempted earlier in this step
        n = min(req.num_tokens - req.num_computed_tokens, self.room_for(req, limit))
        if n <= 0:
            return  # the step's latency plan leaves this row no tokens
        while not self.kv.allocate_slots(req, n):
            if self.suspended and self._release_suspended(out):
                continue  # suspended requests give their blocks back before anyone running
            victim = max(self.running.values(), key=self.policy.victim_key)
            self.take_back(out, victim)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return
        self._give(out, req, n)

    def waits_for_lora(self, req: Request, behind: bool = False) -> LoraWait | None:
        """Why `req`'s LoRA adapter can take no slot in this step (None: it can, or it names none):
        its adapter is being read back from disk (`READING`), or every slot holds an adapter a running
        request uses or (`behind`) an earlier request already waits for the next free slot (`SLOT`)
        (docs/lora.md "More adapters than a step holds"). Changes nothing."""
        slots = self.lora_slots
        if req.lora is None or slots is None or req.lora in slots:
            return None
        if not slots.on_host(req.lora):
            return LoraWait.READING
        return LoraWait.SLOT if behind or not slots.can_take(req.lora, self._running_loras) else None

    def _running_loras(self) -> set[str | None]:
        return {r.lora for r in self.running.values()}

    def start_waiting(self, out: SchedulerOutput, req: Request, limit: int | None = None) -> bool:
        """A new or preempted request holds no blocks: it starts, or restarts, after the longest
        cached prefix of its tokens. A suspended one resumes with its blocks, where it stopped;
        suspended requests give their blocks back (`_release_suspended`) before `req` is refused.
        A request of a LoRA adapter that cannot be stacked (every slot holds a running request's
        adapter) is refused, taking nothing: it waits for a slot (docs/lora.md)."""
        if req.lora is not None and self.lora_slots is not None:
            if not self.lora_slots.admit(req.lora, self._running_loras):
                return False
        hits = [] if req.suspended else self.kv.find_cached_prefix(req)
        num_cached = req.num_computed_tokens if req.suspended else len(hits) * self.kv.block_size
        n = min(req.num_tokens - num_cached, self.room_for(req, limit))
        if n <= 0:
            return False
        while not self.kv.allocate_slots(req, n, hits):
            if not (self.suspended and self._release_suspended(out, keep=req)):
                return False
        self.policy.waiting.take(req)
        if req.suspended:
            del self.suspended[req.request_id]
            req.suspended = False
        req.num_computed_tokens = num_cached
        req.admitted_step = self.step_index
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

    def suspend(self, out: SchedulerOutput, req: Request) -> None:
        """Out of the running set with its blocks and computed tokens kept: waiting again for its
        tenant's counts, at the front of its queue (its arrival is older than any request waiting
        that it did not preempt)."""
        self.take_back(out, req)
        del self.running[req.request_id]
        req.status = RequestStatus.WAITING
        req.suspended = True
        self.suspended[req.request_id] = req
        self.num_suspensions += 1
        self.shares.preempted(req)
        self.policy.waiting.push(req, front=True)

    # ---- preemption ----------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.shares.preempted(req)
        self.policy.waiting.push(req, front=True)

    def _release_suspended(self, out: SchedulerOutput, keep: Request | None = None) -> bool:
        """The KV pool is short: a suspended request (the first in the policy's victim order)
        gives its blocks back and will restart by recomputation, as if preempted. False when none
        other than `keep` holds blocks."""
        held = [r for r in self.suspended.values() if r is not keep]
        if not held:
            return False
        req = max(held, key=self.policy.victim_key)
        del self.suspended[req.request_id]
        req.suspended = False
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        return True

"""ORCA iteration-level scheduling under a token budget, with preemption by recomputation."""

from __future__ import annotations

import time

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.fair_step import DEFAULT_PREFILL_CAP, fill_fair
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import TenantQueues, WaitingQueue
from orcaserve.scheduler.core.slo_budget import StepPlan, plan_for
from orcaserve.scheduler.core.step_builder import StepBuilder
from orcaserve.scheduler.core.step_cost import StepCostModel
from orcaserve.scheduler.core.step_output import SchedulerOutput

POLICIES = ("fcfs", "priority", "fair")
__all__ = ["POLICIES", "Scheduler", "SchedulerOutput"]
# The longest step, as a share of the smallest TTFT target of the requests seen: a request that
# arrives during one still has the rest of its target for its own (docs/latency-targets.md).
ARRIVAL_SHARE = 0.4


class Scheduler(StepBuilder):
    """Chooses the batch of every step; the engine thread is its only caller.

    Each step: running decodes first (one token each, so new arrivals never stall them), then
    running requests that are still catching up (chunked prefill, recomputation), then waiting
    requests in policy order, until `max_num_batched_tokens` or `max_num_seqs` is reached. A long
    prompt takes what budget is left and continues next step. When the KV pool is empty the newest
    (or, under the priority policy, the lowest-priority) running request is preempted: its blocks
    are freed and it is recomputed later from its prompt and the tokens it already produced. With
    prefix caching, a request is admitted (and readmitted) after the longest cached prefix of its
    tokens; freed blocks stay cached until evicted, so a readmission often finds its own.

    Under `fair`, the tenants' virtual token counters (`fair_share.py`) order everything after the
    decodes, tenant by tenant, and the first victim is the newest request of the tenant furthest
    above its share; within a tenant, priority then arrival. When every seat is taken and the
    tenant next in line waits, a seat is handed over: a running request of the tenant furthest
    above its share is suspended, keeping its blocks, and resumes later where it stopped
    (`fair_step.py`; docs/engine.md, "Seat handover"). While a tenant below its share runs in a
    step, the prompt tokens of tenants above theirs are capped at `prefill_cap` (None: never).
    With latency targets, each step's budget comes from them first (slo_budget.py;
    docs/latency-targets.md) and requests with a target go before those without.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        shares: TenantShares | None = None,
        max_suspended: int | None = None,
        prefill_cap: int | None = DEFAULT_PREFILL_CAP,
        step_costs: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or 'fair', got {policy!r}")
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fair = policy == "fair"
        self.by_priority = policy != "fcfs"  # fair: a request's priority orders it within its tenant
        self.shares = shares if shares is not None else TenantShares()
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue | TenantQueues = TenantQueues() if self.fair else WaitingQueue(self.by_priority)
        self.running: dict[str, Request] = {}  # in admission order; O(1) removal
        self.num_preemptions = 0
        # Fair: requests that handed their seat over and keep their blocks, oldest first; at most
        # `max_suspended` (blocks held idle), and the first to give their blocks back.
        self.suspended: dict[str, Request] = {}
        self.max_suspended = max(1, max_num_seqs // 4) if max_suspended is None else max_suspended
        self.num_suspensions = 0
        self.prefill_cap = prefill_cap  # fair: see fair_step.cap_sets
        self.num_capped_steps = 0  # steps in which the cap held prompt tokens back
        self._step_index = 0  # steps scheduled: a request admitted in this one is never suspended in it
        # Prefix cache, in prompt tokens at first admission (readmissions after preemption would
        # count a request's own blocks as hits): tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The step being built: tokens left, and (fair) what its batch so far will charge, per
        # tenant and per request, so that the next choice already sees this step's service.
        self._budget = 0
        self._pending: dict[str | None, float] = {}
        self._charges: dict[str, float] = {}
        # Latency targets (docs/latency-targets.md): the step-cost model, the step's plan, the prompt
        # tokens untargeted rows may still take in it (None: no limit), and requests refused
        # because they can no longer make their TTFT (`take_rejected`).
        self.cost = StepCostModel()
        self.step_costs = step_costs  # False: no latency classes, so nothing reads the model (it is not fitted)
        self.plan = StepPlan(max_num_batched_tokens)
        self._untargeted_left: int | None = None
        self._untargeted: dict[str, int] = {}
        self.rejected: list[Request] = []
        self.arrival_limit: float | None = None  # seconds: a share of the smallest TTFT target seen

    # ---- queue maintenance -------------------------------------------------------------------
    def order_key(self, req: Request) -> tuple[int, int]:
        """The policy's order: smaller runs first, the largest is preempted first."""
        return req.sort_key(self.by_priority)

    def projected(self, tenant: str | None) -> float:
        """`tenant`'s counter with this step's charges so far (fair)."""
        return self.shares.get(tenant).counter + self._pending.get(tenant, 0.0)

    def victim_key(self, req: Request) -> tuple[float, bool, int, int]:
        """The largest is preempted first: newest (or lowest priority), one without a latency
        target before one with; under fair, of the tenant with the largest counter."""
        return (self.projected(req.tenant) if self.fair else 0.0, not req.targeted, *self.order_key(req))

    def add_request(self, req: Request, front: bool = False) -> None:
        """Queue `req`; `front`: ahead of later arrivals (a request's further choices, choices.py)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if req.slo is not None and req.slo.ttft_ms is not None:
            limit = req.slo.ttft_ms / 1000.0 * ARRIVAL_SHARE
            self.arrival_limit = limit if self.arrival_limit is None else min(self.arrival_limit, limit)
        self.shares.arrived(req)
        self.waiting.push(req, front=front)

    def finish_request(self, req: Request, reason: str) -> None:
        """Remove a request for good and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            del self.running[req.request_id]
            self.shares.left(req, was_running=True)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
            self.shares.left(req, was_running=False)
            if req.suspended:
                del self.suspended[req.request_id]
                req.suspended = False
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    # ---- the policy surface (fair_step.py, slo_budget.py): the step being built -------------------
    @property
    def budget_left(self) -> int:
        """Tokens the step being built may still take."""
        return self._budget

    @property
    def step_index(self) -> int:
        """Steps scheduled so far; the one being built included."""
        return self._step_index

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
        self._step_index += 1
        self._pending.clear()
        self._charges.clear()
        # One pass over the running requests: decodes (a request whose token in flight is its
        # last waits for it: docs/host-overlap.md), and those catching up.
        decodes: list[Request] = []
        behind: list[Request] = []
        classed = False
        for r in self.running.values():
            left = len(r.all_token_ids) - r.num_computed_tokens
            if left == 1:
                if not r.final_in_flight:
                    decodes.append(r)
            elif left > 1:
                behind.append(r)
            if r.slo is not None:
                classed = True
        catching_up = sorted(behind, key=lambda r: (not r.targeted, self.order_key(r))) if behind else behind
        self.plan = plan_for(self, decodes, catching_up, time.time(), classed)
        self._continue_decodes(out, decodes)
        if self.fair:
            fill_fair(self, out, catching_up)
        else:
            for req in catching_up:
                self.continue_running(out, req)
            queue = self.waiting
            assert isinstance(queue, WaitingQueue)
            # Admitting new work right after a preemption would only evict it again.
            while not out.preempted and self._can_admit() and (head := queue.peek()) is not None:
                if not self.start_waiting(out, head):
                    break
        out.seal(self.step_costs)  # who samples, and the step in the step-cost model's terms if it learns
        return out

    def _continue_decodes(self, out: SchedulerOutput, decodes: list[Request]) -> None:
        """`continue_running` for each running decode the plan does not sit out, in order; the
        usual case inline (room in its last block, no tenants' charges to count): a decode is no
        prompt row, so the step's only limit for it is the budget."""
        sit_out = self.plan.sit_out
        if self.fair:
            for req in decodes:
                if req.request_id not in sit_out:
                    self.continue_running(out, req)
            return
        nst, reqs, running = out.num_scheduled_tokens, out.requests, RequestStatus.RUNNING
        allocate = self.kv.allocate_slots
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
            else:
                self._budget = budget
                self.continue_running(out, req)  # preempting while the KV pool is short
                budget = self._budget
        self._budget = budget

    def take_rejected(self) -> list[Request]:
        """Requests refused since the last call (finished, reason "rejected"): the engine answers them."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def record_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran `out` in `seconds`: the step-cost model learns from it (without
        `step_costs` it keeps the time alone, the measured step of the metrics)."""
        if out.shape is not None and self.step_costs:
            self.cost.observe(out.shape, seconds)
        elif not out.is_empty:
            self.cost.last_measured = seconds

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by the tokens it computed this step, offer the blocks
        that step filled to the prefix cache and charge the tokens to its tenant (a request that
        failed the step holds no blocks and is not charged), in one pass over the rows and the
        tenants' own."""
        running = RequestStatus.RUNNING
        cache = self.kv.cache_full_blocks if self.kv.enable_prefix_caching else None
        block_size = self.kv.block_size
        reqs, counts = out.requests.values(), out.num_scheduled_tokens.values()  # (one order)
        failed = False
        for req, n in zip(reqs, counts):
            end = req.num_computed_tokens = req.num_computed_tokens + n
            if req.status is not running:  # it failed the step: only its count moves
                failed = True
            # A decode fills a block once in `block_size` steps; only then is there one to offer.
            elif cache is not None and (n > 1 or end % block_size == 0):
                cache(req)
        self.shares.serve(
            [(r, n) for r, n in zip(reqs, counts) if r.status is running] if failed else zip(reqs, counts)
        )
        self.shares.rebase()

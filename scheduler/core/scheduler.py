"""ORCA iteration-level scheduling under a token budget, with preemption by recomputation."""

from __future__ import annotations

import time

from orcaserve.scheduler.core.fair_policy import DEFAULT_PREFILL_CAP
from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.policies import make_policy
from orcaserve.scheduler.core.policy import PolicySettings, SchedulingPolicy
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.request_queue import RequestQueue
from orcaserve.scheduler.core.running_batch import RunningBatch
from orcaserve.scheduler.core.slo_budget import LatencyBudget, StepPlan
from orcaserve.scheduler.core.step_cost import StepCostModel
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.lora.slots import LoraSlots

__all__ = ["Scheduler", "SchedulerOutput"]


class Scheduler:
    """Chooses the batch of every step; the engine thread is its only caller.

    Each step (the ORCA step, the same under every policy): the latency targets' hook sets the
    step's budget (slo_budget.py; docs/latency-targets.md), the running decodes take one token
    each (new arrivals never stall them), then the policy (`scheduling_policy`, policies.py) fills
    the rest: running requests still catching up (chunked prefill, recomputation), targeted ones
    first, and waiting requests in its order, until `max_num_batched_tokens` or `max_num_seqs` is
    reached. A long prompt takes what budget is left and continues next step. When the KV pool is
    empty, the running request first in the policy's victim order is preempted: its blocks are
    freed and it is recomputed later from its prompt and the tokens it already produced. With
    prefix caching, a request is admitted (and readmitted) after the longest cached prefix of its
    tokens; freed blocks stay cached until evicted, so a readmission often finds its own.

    The scheduler owns the requests, the tenants' service (`shares`, counted under every policy)
    and the running batch (running_batch.py), which the policy fills through the `StepBuilder`
    interface (policy.py); the policy owns its waiting queue(s), its order and its counters.
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
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shares = shares if shares is not None else TenantShares()
        self.policy: SchedulingPolicy = make_policy(policy, PolicySettings(max_num_seqs, self.shares, prefill_cap))
        self.requests: dict[str, Request] = {}
        if max_suspended is None:
            max_suspended = max(1, max_num_seqs // 4)
        self.batch = RunningBatch(kv_cache, self.policy, self.shares, max_num_seqs, max_suspended, lora_slots)
        # Latency targets (docs/latency-targets.md): the step-budget hook and its step-cost model,
        # the step's plan, and requests refused because they can no longer make their TTFT
        # (`take_rejected`).
        self.budget = LatencyBudget(max_num_batched_tokens)
        self.step_costs = step_costs  # False: no latency classes, so nothing reads the model (it is not fitted)
        self.plan = StepPlan(max_num_batched_tokens)
        self.rejected: list[Request] = []

    # ---- state, as the engine, its stats and the tests read it ---------------------------------
    @property
    def waiting(self) -> RequestQueue:
        return self.policy.waiting

    @property
    def running(self) -> dict[str, Request]:
        return self.batch.running

    @property
    def suspended(self) -> dict[str, Request]:
        return self.batch.suspended

    @property
    def max_suspended(self) -> int:
        return self.batch.max_suspended

    @property
    def num_preemptions(self) -> int:
        return self.batch.num_preemptions

    @property
    def num_suspensions(self) -> int:
        return self.batch.num_suspensions

    @property
    def prefix_cache_queries(self) -> int:
        return self.batch.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.batch.prefix_cache_hits

    @property
    def cost(self) -> StepCostModel:
        return self.budget.cost

    @property
    def budget_left(self) -> int:
        """Tokens the step just built may still take (speculative proposals take them: spec/decoding.py)."""
        return self.batch.budget_left

    @property
    def num_running(self) -> int:
        return len(self.batch.running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, req: Request, front: bool = False) -> None:
        """Queue `req`; `front`: ahead of later arrivals (a request's further choices, choices.py)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.budget.arrived(req)
        self.shares.arrived(req)
        self.policy.waiting.push(req, front=front)

    def finish_request(self, req: Request, reason: str) -> None:
        """Remove a request for good and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.batch.remove(req)
            self.shares.left(req, was_running=True)
        elif req.status == RequestStatus.WAITING:
            self.policy.waiting.remove(req)
            self.shares.left(req, was_running=False)
            self.batch.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def take_rejected(self) -> list[Request]:
        """Requests refused since the last call (finished, reason "rejected"): the engine answers them."""
        rejected, self.rejected = self.rejected, []
        return rejected

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        batch, policy = self.batch, self.policy
        # One pass over the running requests: decodes (a request whose token in flight is its
        # last waits for it: docs/host-overlap.md), and those catching up.
        decodes: list[Request] = []
        behind: list[Request] = []
        classed = False
        for r in batch.running.values():
            left = len(r.all_token_ids) - r.num_computed_tokens
            if left == 1:
                if not r.final_in_flight:
                    decodes.append(r)
            elif left > 1:
                behind.append(r)
            if r.slo is not None:
                classed = True
        order = policy.order_key
        catching_up = sorted(behind, key=lambda r: (not r.targeted, order(r))) if behind else behind
        targeted_running = classed and any(r.targeted for r in batch.running.values())
        waiting = policy.waiting.targeted()
        plan = self.plan = self.budget.plan(time.time(), decodes, catching_up, waiting, targeted_running)
        for req in plan.missed:  # marked by the hook; refused here when the class says so and it has not started
            fresh = req.status == RequestStatus.WAITING and req.times.first_scheduled is None
            if req.slo is not None and req.slo.reject and fresh:
                self.finish_request(req, "rejected")
                self.rejected.append(req)
        batch.begin(plan.budget, plan.untargeted_prompt)
        batch.continue_decodes(out, decodes, plan.sit_out)
        policy.fill(batch, out, catching_up)
        out.seal(self.step_costs)  # who samples, and the step in the step-cost model's terms if it learns
        return out

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

"""Counters the engine keeps for metrics, and the per-step trace behind the schedule picture."""

from __future__ import annotations

from dataclasses import dataclass, field

from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler, SchedulerOutput


@dataclass
class SloCounts:
    """One class's requests that ended, and how many met their targets (docs/latency-targets.md)."""

    requests: int = 0  # ended: finished, aborted, failed or refused
    ttft_met: int = 0
    tpot_met: int = 0
    good: int = 0  # finished (stop or length) with every target met: goodput's numerator
    late: int = 0  # found unable to make their TTFT and served best effort
    rejected: int = 0  # refused for that (`slo_reject`)


def slo_outcome(req: Request) -> tuple[bool, bool]:
    """(TTFT met, TPOT met) of a request that ended; TPOT as vLLM's benchmark takes it, (e2e -
    TTFT) / (output tokens - 1), met by a request of one token. A target not set is met."""
    slo, t = req.slo, req.times
    assert slo is not None
    first, done, n = t.first_token, t.finished, len(req.output_token_ids)
    ttft_ok = slo.ttft_ms is None or (first is not None and (first - t.arrival) * 1000.0 <= slo.ttft_ms)
    tpot_ok = slo.tpot_ms is None or (
        first is not None and (n <= 1 or (done or first) - first <= slo.tpot_ms / 1000.0 * (n - 1))
    )
    return ttft_ok, tpot_ok


@dataclass
class EngineStats:
    """Running totals and last-step gauges; read by the serving loop after each step."""

    num_blocks: int
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    last_step_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # requests ended by an internal error
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Prefix cache: prompt tokens looked up and found at first admission; free blocks still cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached_free: int = 0
    slo: dict[str, SloCounts] = field(default_factory=dict)  # per latency class

    def record_step(self, sched: SchedulerOutput, scheduler: Scheduler, kv: KVCacheManager, held: int = 0) -> None:
        self.num_steps += 1
        self.last_step_tokens = sched.total_tokens
        self.record_occupancy(scheduler, kv, held)

    def record_occupancy(self, scheduler: Scheduler, kv: KVCacheManager, held: int = 0) -> None:
        """Gauges of who holds what; after steps and after aborts, which free blocks in between.
        `held`: requests waiting outside the scheduler (core/prompt_jobs.py), counted as waiting."""
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting + held
        self.kv_blocks_used = kv.pool.num_used
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = scheduler.prefix_cache_queries
        self.prefix_cache_hits = scheduler.prefix_cache_hits
        self.kv_blocks_cached_free = kv.pool.num_cached_free

    def record_finish(self, req: Request) -> None:
        self.prompt_tokens += req.num_prompt_tokens
        self.generation_tokens += len(req.output_token_ids)
        if req.slo is not None:
            counts = self.slo.setdefault(req.slo.name, SloCounts())
            counts.requests += 1
            counts.late += req.slo_missed and req.finish_reason != "rejected"
            counts.rejected += req.finish_reason == "rejected"
            if req.finish_reason != "rejected":
                ttft_ok, tpot_ok = slo_outcome(req)
                counts.ttft_met += ttft_ok
                counts.tpot_met += tpot_ok
                counts.good += ttft_ok and tpot_ok and req.finish_reason in ("stop", "length")

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.num_blocks


@dataclass
class StepTrace:
    """What one iteration ran: per request, the tokens it fed and whether they were prefill."""

    start: float
    end: float
    # request id -> (prefill tokens, decode tokens) this step
    requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    kv_blocks_used: int = 0
    num_waiting: int = 0

    @classmethod
    def of(
        cls, sched: SchedulerOutput, kv: KVCacheManager, start: float, end: float, scheduler: Scheduler
    ) -> StepTrace:
        rows = {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = sched.requests[rid]
            # After the step, a request fed a decode token iff it had exactly one token to catch up
            # and that token was one it generated itself.
            computed_before = req.num_computed_tokens - n
            decode = n == 1 and computed_before >= req.num_prompt_tokens
            rows[rid] = (0, 1) if decode else (n, 0)
        return cls(start, end, rows, list(sched.preempted), kv.pool.num_used, scheduler.num_waiting)

    def to_dict(self) -> dict:
        return {
            "start": self.start,
            "end": self.end,
            "requests": {k: list(v) for k, v in self.requests.items()},
            "preempted": self.preempted,
            "kv_blocks_used": self.kv_blocks_used,
            "num_waiting": self.num_waiting,
        }

"""What the engine publishes for metrics: an immutable snapshot of its counters, gauges, tenants,
latency classes and step-cost model, built on the loop thread after each step and after aborts
(`Engine.snapshot`). Readers (the serving layer's metrics) see numbers, never live engine state."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.stats import EngineStats, SloCounts
from orcaserve.scheduler.core.step_cost import StepCostModel
from orcaserve.scheduler.lora.runtime import LoraStats
from orcaserve.scheduler.spec.stats import SpecStats


class TenantSnapshot(NamedTuple):
    """One tenant's requests and service (`fair_share.Tenant`); a tuple, as it is built for every
    tenant after every step."""

    name: str | None  # None: requests that name no tenant
    prompt_tokens: int
    output_tokens: int
    waiting: int
    running: int
    service: float  # weighted service since the engine started, in counter units (`TenantShares.service`)

    @property
    def backlogged(self) -> bool:
        return self.waiting > 0


def tenant_snapshots(shares: TenantShares) -> tuple[TenantSnapshot, ...]:
    """Every tenant the engine has seen, in the order it first saw them."""
    return tuple(
        TenantSnapshot(t.name, t.prompt_tokens, t.output_tokens, t.waiting, t.running, shares.service(t))
        for t in shares.tenants.values()
    )


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """The engine's numbers at one moment; field meanings as in `EngineStats`."""

    num_blocks: int
    num_steps: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    last_step_tokens: int
    num_preemptions: int
    num_aborted: int
    num_failed: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_blocks_cached_free: int
    slo: Mapping[str, SloCounts]  # per latency class, copies
    tenants: tuple[TenantSnapshot, ...]
    # The step-cost model (core/step_cost.py): the last step's predicted and measured seconds, and
    # its mean relative error; None until it has them.
    step_time_predicted: float | None
    step_time_measured: float | None
    step_cost_error: float | None
    spec: SpecStats | None = None  # speculative decoding's counters (a copy); None: speculation off
    lora: LoraStats | None = None  # the LoRA adapters' numbers; None: no adapters served

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.num_blocks

    @classmethod
    def of(
        cls,
        stats: EngineStats,
        shares: TenantShares,
        cost: StepCostModel,
        spec: SpecStats | None = None,
        lora: LoraStats | None = None,
    ) -> StatsSnapshot:
        return cls(
            num_blocks=stats.num_blocks,
            num_steps=stats.num_steps,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_blocks_used=stats.kv_blocks_used,
            last_step_tokens=stats.last_step_tokens,
            num_preemptions=stats.num_preemptions,
            num_aborted=stats.num_aborted,
            num_failed=stats.num_failed,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            kv_blocks_cached_free=stats.kv_blocks_cached_free,
            slo={name: copy.copy(counts) for name, counts in stats.slo.items()},
            tenants=tenant_snapshots(shares),
            step_time_predicted=cost.last_predicted,
            step_time_measured=cost.last_measured,
            step_cost_error=cost.relative_error,
            spec=None if spec is None else copy.deepcopy(spec),  # its per-position lists too
            lora=lora,
        )

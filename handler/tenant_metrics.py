"""Per-tenant metrics: tokens served, waiting and running requests, and Jain's fairness index
over backlogged tenants (`orcaserve.scheduler.core.fair_share`), emitted by `EngineMetrics` from
the engine's snapshot of its tenants.

Tenants are named by `tenant_header` (set by a trusted gateway); requests without one (no header
configured) count as the tenant "-". Each emission sends only the series that changed, so a
deployment with many tenants writes lines for the busy ones.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

from ts.metrics.metric_type_enum import MetricTypes

from orcaserve.scheduler.core.fair_share import jain_index
from orcaserve.scheduler.core.stats_snapshot import TenantSnapshot

G, C = MetricTypes.GAUGE, MetricTypes.COUNTER

# name -> (unit, type, help); the per-tenant ones carry the dimension `Tenant`.
TENANT_METRICS: dict[str, tuple[str, MetricTypes, str]] = {
    "orca_tenant_prompt_tokens_total": ("count", C, "prompt tokens computed for a tenant (cache hits excluded)"),
    "orca_tenant_generation_tokens_total": ("count", C, "tokens generated for a tenant"),
    "orca_tenant_requests_waiting": ("count", G, "a tenant's requests waiting to be scheduled"),
    "orca_tenant_requests_running": ("count", G, "a tenant's requests in the running batch"),
}
FAIRNESS_METRIC = ("orca_tenant_fairness_index", "ratio", G, "Jain's index over backlogged tenants' weighted service")
# Jain's index compares the service of tenants that were backlogged at both ends of a window; a
# few steps are too few (a tenant waiting for a slot gets nothing for a while under any policy).
FAIRNESS_WINDOW_S = 5.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def tenant_label(name: str | None) -> str:
    """A label value the frontend's log parser takes: `,`, `:` or `|` would split the line."""
    return "-" if name is None else _UNSAFE.sub("_", name)[:64] or "_"


class TenantMetrics:
    """`emit(name, value, tenant)` writes one metric line (tenant None: no Tenant dimension)."""

    def __init__(self, emit: Callable[[str, float, str | None], None]) -> None:
        self._emit = emit
        self._sent: dict[tuple[str, str], float] = {}  # (metric, label) -> last total or gauge sent
        self._window_start = time.monotonic()
        self._window_service: dict[str | None, float] = {}  # backlogged tenants at the window's start

    def on_emission(self, tenants: Sequence[TenantSnapshot]) -> None:
        """On the engine loop thread, whenever `EngineMetrics` emits its gauges."""
        for t in tenants:
            label = tenant_label(t.name)
            for name, value in (
                ("orca_tenant_prompt_tokens_total", t.prompt_tokens),
                ("orca_tenant_generation_tokens_total", t.output_tokens),
                ("orca_tenant_requests_waiting", t.waiting),
                ("orca_tenant_requests_running", t.running),
            ):
                last = self._sent.get((name, label), 0)
                if value == last and (name, label) in self._sent:
                    continue
                self._sent[(name, label)] = value
                # Counters go out as increments, gauges as values (a first 0 registers the series).
                self._emit(name, value - last if TENANT_METRICS[name][1] is C else value, label)
        now = time.monotonic()
        if now - self._window_start >= FAIRNESS_WINDOW_S:
            self._emit(FAIRNESS_METRIC[0], round(self.fairness(tenants), 4), None)
            self._window_start = now
            self._window_service = {t.name: t.service for t in tenants if t.backlogged}

    def fairness(self, tenants: Sequence[TenantSnapshot]) -> float:
        """Jain's index of the weighted service (tokens times their cost, over the tenant's
        weight) that tenants backlogged at both ends of the window got in it; 1 with fewer than two."""
        got = [
            t.service - self._window_service[t.name] for t in tenants if t.backlogged and t.name in self._window_service
        ]
        return jain_index(got) if len(got) >= 2 else 1.0

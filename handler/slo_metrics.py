"""Latency-target metrics: per class, requests ended and how many met their TTFT, their TPOT and
both (goodput is the rate of the last); and the step-cost model's predicted and measured step
time and its error (docs/latency-targets.md, "Metrics"). Emitted by `EngineMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable

from ts.metrics.metric_type_enum import MetricTypes

from orcaserve.handler.tenant_metrics import tenant_label
from orcaserve.scheduler.core.stats_snapshot import StatsSnapshot

G, C = MetricTypes.GAUGE, MetricTypes.COUNTER

# name -> (unit, type, help, SloCounts field); the dimension `Class` names the class.
SLO_METRICS: dict[str, tuple[str, MetricTypes, str, str]] = {
    "orca_slo_requests_total": ("count", C, "requests of a latency class that ended", "requests"),
    "orca_slo_ttft_met_total": ("count", C, "of those, met their TTFT target", "ttft_met"),
    "orca_slo_tpot_met_total": ("count", C, "of those, met their TPOT target", "tpot_met"),
    "orca_slo_good_total": ("count", C, "finished with every target met (rate: goodput)", "good"),
    "orca_slo_late_total": ("count", C, "could no longer make their TTFT; served best effort", "late"),
    "orca_slo_rejected_total": ("count", C, "could no longer make their TTFT; refused (slo_reject)", "rejected"),
}
# Gauges without a class: the step-cost model (scheduler/core/step_cost.py).
STEP_COST_METRICS: dict[str, tuple[str, MetricTypes, str]] = {
    "orca_step_time_predicted_seconds": ("s", G, "the step-cost model's prediction for the last step"),
    "orca_step_time_measured_seconds": ("s", G, "the last step's measured time"),
    "orca_step_cost_relative_error": ("ratio", G, "mean |predicted - measured| / measured over recent steps"),
}


class SloMetrics:
    """`emit(name, value, label)` writes one metric line (label None: no Class dimension)."""

    def __init__(self, emit: Callable[[str, float, str | None], None]) -> None:
        self._emit = emit
        self._sent: dict[tuple[str, str], int] = {}

    def on_emission(self, snapshot: StatsSnapshot) -> None:
        """On the engine loop thread, whenever `EngineMetrics` emits its gauges."""
        for cls, c in snapshot.slo.items():
            label = tenant_label(cls)
            for name, (*_, attr) in SLO_METRICS.items():
                value, last = getattr(c, attr), self._sent.get((name, label))
                if value == last:
                    continue
                self._sent[(name, label)] = value
                self._emit(name, value - (last or 0), label)  # increments; a first 0 registers the series
        for name, value in (
            ("orca_step_time_predicted_seconds", snapshot.step_time_predicted),
            ("orca_step_time_measured_seconds", snapshot.step_time_measured),
            ("orca_step_cost_relative_error", snapshot.step_cost_error),
        ):
            if value is not None:
                self._emit(name, round(value, 6), None)

"""Speculative decoding's metrics (docs/speculative-decoding.md "Metrics"): proposed and accepted
tokens, the steps that speculated, those that could have and did not and those whose proposer
raised, as counters, and the mean accepted length as a gauge; the dimension `Method` names the
proposer. Emitted by `EngineMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable

from ts.metrics.metric_type_enum import MetricTypes

from orcaserve.scheduler.spec.stats import SpecStats

G, C = MetricTypes.GAUGE, MetricTypes.COUNTER

# name -> (unit, type, help, SpecStats field)
SPEC_METRICS: dict[str, tuple[str, MetricTypes, str, str]] = {
    "orca_spec_proposed_tokens_total": ("count", C, "proposed tokens checked by the target", "proposed"),
    "orca_spec_accepted_tokens_total": ("count", C, "proposed tokens accepted", "accepted"),
    "orca_spec_steps_on_total": ("count", C, "steps in which a row speculated", "steps_on"),
    "orca_spec_steps_off_total": ("count", C, "steps whose decode rows could have speculated and did not", "steps_off"),
    "orca_spec_failed_steps_total": ("count", C, "steps whose proposer raised: they decoded plainly", "failed_steps"),
    "orca_spec_mean_accepted_length": ("tokens", G, "tokens a speculated row emitted per step", "mean_accepted_length"),
}


class SpecMetrics:
    """`emit(name, value, method)` writes one metric line with the Method dimension."""

    def __init__(self, emit: Callable[[str, float, str], None]) -> None:
        self._emit = emit
        self._sent: dict[str, float] = {}

    def on_emission(self, stats: SpecStats | None) -> None:
        """On the engine loop thread, whenever `EngineMetrics` emits its gauges (None: speculation off)."""
        if stats is None:
            return
        for name, (_, kind, _, attr) in SPEC_METRICS.items():
            value, last = getattr(stats, attr), self._sent.get(name)
            if value == last:
                continue
            self._sent[name] = value
            self._emit(name, round(value, 4) if kind is G else value - (last or 0), stats.method)

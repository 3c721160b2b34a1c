"""LoRA adapters' metrics (docs/lora.md "Metrics"): per adapter (dimension `Adapter`) the requests
that named it and the tokens computed under it, as counters; the adapters on the host and those
stacked for the steps, as gauges; runtime loads and unloads, adapters given a slot and adapters
evicted from one, adapters evicted from host memory and read back from disk, as counters. Emitted
by `EngineMetrics` from the engine's `LoraStats`.
"""

from __future__ import annotations

from collections.abc import Callable

from ts.metrics.metric_type_enum import MetricTypes

from orcaserve.handler.tenant_metrics import tenant_label
from orcaserve.scheduler.lora.runtime import LoraStats

G, C = MetricTypes.GAUGE, MetricTypes.COUNTER

# name -> (unit, type, help); the per-adapter ones carry the dimension `Adapter`.
ADAPTER_METRICS: dict[str, tuple[str, MetricTypes, str]] = {
    "orca_lora_requests_total": ("count", C, "requests that named a LoRA adapter"),
    "orca_lora_tokens_total": ("count", C, "tokens computed under a LoRA adapter (prompt and generated)"),
}
# name -> (unit, type, help, LoraStats field)
LORA_METRICS: dict[str, tuple[str, MetricTypes, str, str]] = {
    "orca_lora_adapters_loaded": ("count", G, "LoRA adapters held on the host (max_cpu_loras)", "loaded"),
    "orca_lora_adapters_stacked": ("count", G, "LoRA adapters stacked for the steps (max_loras)", "stacked"),
    "orca_lora_loads_total": ("count", C, "LoRA adapters loaded while serving", "loads"),
    "orca_lora_unloads_total": ("count", C, "LoRA adapters unloaded while serving", "unloads"),
    "orca_lora_swaps_total": ("count", C, "LoRA adapters given a slot for the steps", "swaps"),
    "orca_lora_evictions_total": ("count", C, "LoRA adapters that lost their slot to another (LRU)", "evictions"),
    "orca_lora_host_evictions_total": ("count", C, "LoRA adapters evicted from host memory", "host_evictions"),
    "orca_lora_rereads_total": ("count", C, "LoRA adapters read back from disk after an eviction", "rereads"),
}


class LoraMetrics:
    """`emit(name, value, adapter)` writes one metric line (adapter None: no Adapter dimension)."""

    def __init__(self, emit: Callable[[str, float, str | None], None]) -> None:
        self._emit = emit
        self._sent: dict[tuple[str, str | None], float] = {}

    def on_emission(self, stats: LoraStats | None) -> None:
        """On the engine loop thread, whenever `EngineMetrics` emits its gauges (None: no adapters)."""
        if stats is None:
            return
        for name, (_, kind, _, attr) in LORA_METRICS.items():
            self._send(name, kind, getattr(stats, attr), None)
        for name, series in (("orca_lora_requests_total", stats.requests), ("orca_lora_tokens_total", stats.tokens)):
            for adapter, value in series:
                self._send(name, C, value, tenant_label(adapter))

    def _send(self, name: str, kind: MetricTypes, value: float, label: str | None) -> None:
        last = self._sent.get((name, label))
        if value == last:
            return
        self._sent[(name, label)] = value
        # Counters go out as increments, gauges as values (a first 0 registers the series).
        self._emit(name, value - (last or 0) if kind is C else value, label)

"""Engine and request metrics, emitted through TorchServe's backend metrics.

TorchServe's backend metrics are log lines (`[METRICS]name.unit:value|#dims|#type:...`) that the
frontend parses and, with `metrics_mode=prometheus`, exposes at `:8082/metrics`. Emitting is a
`logger.info` call, safe from any thread: gauges come from the engine loop thread (`on_step`),
request latencies from the asyncio thread when a request finishes. The numbers come from the
engine's `StatsSnapshot` (scheduler/core/stats_snapshot.py) and each output's timestamps, never
from live engine state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ts.metrics.metric_type_enum import MetricTypes

from orcaserve.handler.lora_metrics import ADAPTER_METRICS, LORA_METRICS, LoraMetrics
from orcaserve.handler.slo_metrics import SLO_METRICS, STEP_COST_METRICS, SloMetrics
from orcaserve.handler.spec_metrics import SPEC_METRICS, SpecMetrics
from orcaserve.handler.tenant_metrics import FAIRNESS_METRIC, TENANT_METRICS, TenantMetrics
from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.stats_snapshot import StatsSnapshot
from orcaserve.scheduler.errors import EngineError, Overloaded

log = logging.getLogger(__name__)

H, G, C = MetricTypes.HISTOGRAM, MetricTypes.GAUGE, MetricTypes.COUNTER

# name -> (unit, type, help). Latencies are histograms in seconds (Prometheus default buckets
# span 5 ms .. 10 s); token counts per step would not fit those buckets, so they are counters.
METRICS: dict[str, tuple[str, MetricTypes, str]] = {
    "orca_time_to_first_token_seconds": ("s", H, "arrival to first generated token"),
    "orca_time_per_output_token_seconds": ("s", H, "mean gap between output tokens of a request"),
    "orca_queue_time_seconds": ("s", H, "arrival to first scheduling"),
    "orca_e2e_latency_seconds": ("s", H, "arrival to finish"),
    "orca_num_requests_running": ("count", G, "requests in the running batch"),
    "orca_num_requests_waiting": ("count", G, "sequences accepted and not yet running, wherever they wait"),
    "orca_kv_blocks_used": ("count", G, "KV cache blocks in use"),
    "orca_kv_cache_usage_ratio": ("ratio", G, "used / total KV blocks"),
    "orca_step_tokens": ("count", G, "tokens fed in the last step"),
    "orca_step_tokens_total": ("count", C, "tokens fed over all steps"),
    "orca_steps_total": ("count", C, "engine steps"),
    "orca_preemptions_total": ("count", C, "requests preempted (KV blocks reclaimed)"),
    "orca_aborts_total": ("count", C, "requests aborted (deadline, shutdown, client)"),
    "orca_request_failures_total": ("count", C, "requests failed by an internal error"),
    "orca_generation_tokens_total": ("count", C, "tokens generated"),
    # vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the prompt-token hit rate.
    "orca_prefix_cache_queries_total": ("count", C, "prompt tokens looked up in the prefix cache"),
    "orca_prefix_cache_hits_total": ("count", C, "prompt tokens found in the prefix cache"),
    "orca_prefix_cache_free_blocks": ("count", G, "free KV blocks still holding a reusable prefix"),
}

# Requests refused before they ran (503 overloaded, 400 too long, ...), one series per reason
# (`EngineError.reason`): docs/serving.md, "Limits and refusals".
REFUSED_METRIC = ("orca_requests_refused_total", "count", C, "requests refused before they ran, by reason")

# The KV cache's shape for the Gateway API Inference Extension's endpoint picker, in the form of
# vLLM's `vllm:cache_config_info` that it reads (value 1, the numbers in labels): docs/deploy.md,
# "The fleet". Its waiting, running and KV-utilization gauges are the orca_num_requests_* and
# orca_kv_cache_usage_ratio series above (GATEWAY_METRICS).
CACHE_INFO_METRIC = ("orca_cache_config_info", "count", G, "1; the KV cache's block_size and num_gpu_blocks as labels")
CACHE_INFO_DIMENSIONS = ["block_size", "num_gpu_blocks"]
# The endpoint picker's metric flag -> the series to name in it (TorchServe's backend metric names
# are [A-Za-z0-9_] only, so the picker's default vllm:* names cannot be produced).
GATEWAY_METRICS = {
    "total-queued-requests-metric": "orca_num_requests_waiting",
    "total-running-requests-metric": "orca_num_requests_running",
    "kv-cache-usage-percentage-metric": "orca_kv_cache_usage_ratio",
    "cache-info-metric": CACHE_INFO_METRIC[0],
}

DIMENSIONS = ["ModelName", "Level"]
# Gauges are re-emitted at most this often while nothing changes, to keep the log volume sane.
_GAUGE_PERIOD_S = 1.0
# ... and while they change (nearly every step under load), at most this often, except when the
# engine goes idle: each emission is up to 14 log lines that the worker writes and the frontend
# parses, and at every step they were 7,500 of the 13,000 lines the frontend logged over two HTTP
# benchmark runs. Counters go out as the increments since the previous emission: none is lost.
_MIN_PERIOD_S = 0.25


class EngineMetrics:
    """Publishes engine gauges/counters after each step and latencies per finished request."""

    def __init__(self, metrics_cache: Any, model_name: str) -> None:
        self._dims = [model_name, "Model"]
        self._metrics = {}
        if metrics_cache is not None:
            for name, (unit, kind, _) in METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, list(DIMENSIONS), kind)
            for name, (unit, kind, _) in TENANT_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, [*DIMENSIONS, "Tenant"], kind)
            for name, (unit, kind, *_) in SLO_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, [*DIMENSIONS, "Class"], kind)
            for name, (unit, kind, _) in STEP_COST_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, list(DIMENSIONS), kind)
            for name, (unit, kind, *_) in SPEC_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, [*DIMENSIONS, "Method"], kind)
            for name, (unit, kind, *_) in LORA_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, list(DIMENSIONS), kind)
            for name, (unit, kind, _) in ADAPTER_METRICS.items():
                self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, [*DIMENSIONS, "Adapter"], kind)
            name, unit, kind, _ = FAIRNESS_METRIC
            self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, list(DIMENSIONS), kind)
            name, unit, kind, _ = REFUSED_METRIC
            self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, [*DIMENSIONS, "Reason"], kind)
            name, unit, kind, _ = CACHE_INFO_METRIC
            dims = [*DIMENSIONS, *CACHE_INFO_DIMENSIONS]
            self._metrics[name] = metrics_cache.add_metric_to_cache(name, unit, dims, kind)
        self._tenants = TenantMetrics(self._emit)
        self._slo = SloMetrics(self._emit)
        self._spec = SpecMetrics(self._emit)
        self._lora = LoraMetrics(self._emit)
        self._last_gauges: tuple = ()
        self._last_gauge_time = 0.0
        self._counted = {
            "orca_preemptions_total": 0,
            "orca_aborts_total": 0,
            "orca_steps_total": 0,
            "orca_generation_tokens_total": 0,
            "orca_step_tokens_total": 0,
            "orca_request_failures_total": 0,
            "orca_prefix_cache_queries_total": 0,
            "orca_prefix_cache_hits_total": 0,
        }
        self._step_tokens = 0
        self._last_step = 0
        # Announce every non-histogram series at zero: the frontend registers a backend metric only
        # when it first sees it, and a counter that never moves (no preemptions) would be missing.
        for name, (_, kind, _) in METRICS.items():
            if kind is not H:
                self._emit(name, 0)
        self._emit(FAIRNESS_METRIC[0], 1.0)
        self._emit_with(REFUSED_METRIC[0], 0, [Overloaded.reason])

    def _emit(self, name: str, value: float, tenant: str | None = None) -> None:
        self._emit_with(name, value, [] if tenant is None else [tenant])

    def _emit_with(self, name: str, value: float, extra_dims: list[str]) -> None:
        metric = self._metrics.get(name)
        if metric is not None:
            metric.add_or_update(value, [*self._dims, *extra_dims])

    def on_start(self, block_size: int, num_blocks: int) -> None:
        """Once the engine is built: the KV cache's shape (fixed for the engine's life)."""
        self._emit_with(CACHE_INFO_METRIC[0], 1, [str(block_size), str(num_blocks)])

    def on_refused(self, error: EngineError) -> None:
        """A request refused before it ran (any thread): one more in its reason's series."""
        self._emit_with(REFUSED_METRIC[0], 1, [error.reason])

    def on_step(self, s: StatsSnapshot) -> None:
        """Engine-loop callback (after each step and after aborts, on the loop thread): on a
        change of the gauges, at most every `_MIN_PERIOD_S` while the engine is busy and at once
        when it goes idle (or every `_GAUGE_PERIOD_S` unchanged), emit them and the counters'
        increments since the previous emission."""
        if s.num_steps != self._last_step:
            self._last_step = s.num_steps
            self._step_tokens += s.last_step_tokens
        # Counters are part of the change test: an abort while idle (a deadline that passed before
        # the first step) changes no gauge, and nothing else would report it.
        gauges = (
            s.num_running,
            s.num_waiting,
            s.kv_blocks_used,
            s.last_step_tokens,
            s.kv_blocks_cached_free,
            s.num_aborted,
            s.num_failed,
            s.num_preemptions,
            s.lora,  # an adapter loaded or unloaded while idle
        )
        now = time.monotonic()
        since = now - self._last_gauge_time
        if gauges == self._last_gauges and since < _GAUGE_PERIOD_S:
            return
        if since < _MIN_PERIOD_S and (s.num_running or s.num_waiting):
            return
        self._last_gauges, self._last_gauge_time = gauges, now
        self._emit_deltas(
            {
                "orca_preemptions_total": s.num_preemptions,
                "orca_aborts_total": s.num_aborted,
                "orca_steps_total": s.num_steps,
                "orca_generation_tokens_total": s.generation_tokens,
                "orca_step_tokens_total": self._step_tokens,
                "orca_request_failures_total": s.num_failed,
                "orca_prefix_cache_queries_total": s.prefix_cache_queries,
                "orca_prefix_cache_hits_total": s.prefix_cache_hits,
            }
        )
        self._emit("orca_num_requests_running", s.num_running)
        self._emit("orca_num_requests_waiting", s.num_waiting)
        self._emit("orca_kv_blocks_used", s.kv_blocks_used)
        self._emit("orca_kv_cache_usage_ratio", round(s.kv_usage, 4))
        self._emit("orca_step_tokens", s.last_step_tokens)
        self._emit("orca_prefix_cache_free_blocks", s.kv_blocks_cached_free)
        self._tenants.on_emission(s.tenants)
        self._slo.on_emission(s)
        self._spec.on_emission(s.spec)
        self._lora.on_emission(s.lora)

    def _emit_deltas(self, totals: dict[str, int]) -> None:
        for name, total in totals.items():
            delta = total - self._counted[name]
            if delta > 0:
                self._counted[name] = total
                self._emit(name, delta)

    def on_finish(self, out: RequestOutput) -> None:
        """Latencies of one finished request, from its output's snapshot of timestamps (asyncio
        thread). Never raises: metrics must not fail a request."""
        try:
            t = out.times
            if t.first_scheduled is not None:
                self._emit("orca_queue_time_seconds", max(0.0, t.first_scheduled - t.arrival))
            if t.first_token is not None:
                self._emit("orca_time_to_first_token_seconds", max(0.0, t.first_token - t.arrival))
                if out.completion_tokens > 1 and t.finished is not None:
                    tpot = (t.finished - t.first_token) / (out.completion_tokens - 1)
                    self._emit("orca_time_per_output_token_seconds", max(0.0, tpot))
            if t.finished is not None:
                self._emit("orca_e2e_latency_seconds", max(0.0, t.finished - t.arrival))
        except Exception:
            log.exception("metrics emission failed")

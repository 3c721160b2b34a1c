"""Latency-class metrics as TorchServe's backend emits them: per-class counters add up to the
engine's, and the step-cost model's predicted and measured step times go out."""

from __future__ import annotations

import logging
import re

import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.scheduler import SamplingParams

ts_metrics = pytest.importorskip("ts.metrics.metric_cache_yaml_impl")
ts_async = pytest.importorskip("ts.async_service")

from orcaserve.handler.metrics import EngineMetrics  # noqa: E402

CLASSES = {"chat": {"ttft_ms": 600000, "tpot_ms": 600000}, "bulk": {}}


def test_per_class_series_add_up_and_step_times_go_out(engine_for, caplog):
    cache = ts_metrics.MetricsCacheYamlImpl(
        config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
    )
    cache.initialize_cache()
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32, slo_classes=CLASSES)
    metrics = EngineMetrics(cache, "tiny")
    with caplog.at_level(logging.INFO):
        for i, cls in enumerate(["chat", "bulk", "chat", None, "chat", "bulk"]):
            prompt = [(3 * i + j) % (TINY_VOCAB - 3) + 3 for j in range(14)]
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params, slo_class=cls)
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
    tagged = re.compile(r"\[METRICS\](\w+)\.\w+:([\d.]+)\|#[^|]*Class:([^,|]+)")
    series: dict[tuple[str, str], float] = {}
    for m in map(tagged.search, caplog.messages):
        if m:
            series[(m.group(1), m.group(3))] = series.get((m.group(1), m.group(3)), 0.0) + float(m.group(2))
    assert series[("orca_slo_requests_total", "chat")] == series[("orca_slo_good_total", "chat")] == 3
    assert series[("orca_slo_ttft_met_total", "chat")] == series[("orca_slo_tpot_met_total", "chat")] == 3
    assert series[("orca_slo_requests_total", "bulk")] == series[("orca_slo_good_total", "bulk")] == 2
    assert engine.stats.slo["chat"].requests == 3 and "None" not in engine.stats.slo
    untagged = {m.group(1) for m in map(re.compile(r"\[METRICS\](orca_step_\w+)\.").search, caplog.messages) if m}
    assert {"orca_step_time_predicted_seconds", "orca_step_time_measured_seconds"} <= untagged

"""Engine metrics as TorchServe's backend emits them: how often, and that counters add up."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.scheduler import SamplingParams

ts_metrics = pytest.importorskip("ts.metrics.metric_cache_yaml_impl")
ts_async = pytest.importorskip("ts.async_service")

from orcaserve.handler.metrics import EngineMetrics  # noqa: E402

LINE = re.compile(r"\[METRICS\](\w+)\.\w+:([\d.]+)\|")


def test_busy_steps_are_sampled_and_the_idle_state_goes_out(engine_for, caplog):
    """Under load the gauges go out at most every 0.25 s, not at every step; the step that leaves
    the engine idle is emitted at once, and the counters' increments add up to the engine's totals."""
    cache = ts_metrics.MetricsCacheYamlImpl(
        config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
    )
    cache.initialize_cache()
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32)
    metrics = EngineMetrics(cache, "tiny")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for i in range(6):
            engine.add_request(
                f"r{i}",
                [(5 * i + j) % (TINY_VOCAB - 3) + 3 for j in range(20)],
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            )
        steps = 0
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
            steps += 1
    emitted = [(m.group(1), float(m.group(2))) for m in map(LINE.search, caplog.messages) if m]
    running = [v for name, v in emitted if name == "orca_num_requests_running"]
    assert steps > 10 and 1 <= len(running) < steps / 2
    assert running[-1] == 0  # the idle state, emitted although the previous emission was just now
    tokens = sum(v for name, v in emitted if name == "orca_generation_tokens_total")
    assert tokens == engine.stats.generation_tokens == 6 * 24
    assert sum(v for name, v in emitted if name == "orca_steps_total") == engine.stats.num_steps == steps


def test_per_tenant_series_add_up_and_the_fairness_index_goes_out(engine_for, caplog, monkeypatch):
    """Per-tenant token counters add up to the engine's own, gauges end at 0, labels are made
    safe for the frontend's parser, and Jain's index goes out once per window."""
    from orcaserve.handler import tenant_metrics

    monkeypatch.setattr(tenant_metrics, "FAIRNESS_WINDOW_S", 0.0)
    cache = ts_metrics.MetricsCacheYamlImpl(
        config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
    )
    cache.initialize_cache()
    engine = engine_for(tiny_model("llama"), max_num_seqs=2, max_num_batched_tokens=32, scheduling_policy="fair")
    metrics = EngineMetrics(cache, "tiny")
    with caplog.at_level(logging.INFO):
        for i, tenant in enumerate(["acme", "b,c|d", None] * 3):
            prompt = [(7 * i + j) % (TINY_VOCAB - 3) + 3 for j in range(12)]
            engine.add_request(
                f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), tenant=tenant
            )
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
    tagged = re.compile(r"\[METRICS\](\w+)\.\w+:([\d.]+)\|#[^|]*Tenant:([^,|]+)")
    series: dict[tuple[str, str], list[float]] = {}
    for m in map(tagged.search, caplog.messages):
        if m:
            series.setdefault((m.group(1), m.group(3)), []).append(float(m.group(2)))
    shares = engine.scheduler.shares.tenants
    for name, label in (("acme", "acme"), ("b,c|d", "b_c_d"), (None, "-")):
        assert sum(series[("orca_tenant_generation_tokens_total", label)]) == shares[name].output_tokens == 30
        assert sum(series[("orca_tenant_prompt_tokens_total", label)]) == shares[name].prompt_tokens == 36
        assert series[("orca_tenant_requests_running", label)][-1] == 0
        assert series[("orca_tenant_requests_waiting", label)][-1] == 0
    index = [
        float(m.group(1))
        for m in map(re.compile(r"orca_tenant_fairness_index\.\w+:([\d.]+)").search, caplog.messages)
        if m
    ]
    assert len(index) >= 2 and all(0.3 <= x <= 1.0 for x in index)  # announced, then per window


def test_jain_index_over_tenants_backlogged_across_the_window():
    from orcaserve.handler.tenant_metrics import TenantMetrics
    from orcaserve.scheduler.core.fair_share import TenantShares
    from orcaserve.scheduler.core.stats_snapshot import tenant_snapshots

    shares = TenantShares({"a": 2})
    a, b, idle = shares.get("a"), shares.get("b"), shares.get("idle")
    a.waiting = b.waiting = 1
    metrics = TenantMetrics(lambda *args: None)
    metrics._window_service = {"a": 0.0, "b": 0.0, "idle": 0.0}
    a.output_tokens, b.output_tokens, idle.output_tokens = 6, 1, 50  # in counter units: 6, 2 (idle: not backlogged)
    assert metrics.fairness(tenant_snapshots(shares)) == (6 + 2) ** 2 / (2 * (36 + 4))
    b.waiting = 0
    assert metrics.fairness(tenant_snapshots(shares)) == 1.0


def test_refusals_go_out_by_reason_and_the_waiting_gauge_takes_the_loops_count(engine_for, caplog):
    """A refusal is one increment in its reason's series at once (from any thread); the waiting
    gauge reports what the engine loop counts (accepted, not running) when it is given."""
    from orcaserve.scheduler.errors import Overloaded, PromptTooLong

    cache = ts_metrics.MetricsCacheYamlImpl(
        config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
    )
    cache.initialize_cache()
    engine = engine_for(tiny_model("llama"), max_num_seqs=2, max_num_batched_tokens=32)
    with caplog.at_level(logging.INFO):
        metrics = EngineMetrics(cache, "tiny")
        metrics.on_refused(Overloaded("full", retry_after=1))
        metrics.on_refused(PromptTooLong("long"))
        metrics.on_step(dataclasses.replace(engine.snapshot(), num_waiting=5))
    reason = re.compile(r"\[METRICS\]orca_requests_refused_total\.\w+:([\d.]+)\|#[^|]*Reason:(\w+)")
    refused = [(m.group(2), float(m.group(1))) for m in map(reason.search, caplog.messages) if m]
    assert refused == [("overloaded", 0.0), ("overloaded", 1.0), ("too_long", 1.0)]
    emitted = [(m.group(1), float(m.group(2))) for m in map(LINE.search, caplog.messages) if m]
    assert ("orca_num_requests_waiting", 5.0) in emitted

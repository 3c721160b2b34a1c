"""Speculative decoding's metrics as TorchServe's backend emits them: read from the snapshot the
engine publishes (a copy, not the live counters), with the proposer's method as a dimension, the
counters' increments adding up to the engine's totals."""

from __future__ import annotations

import logging
import re

import pytest

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.scheduler import SamplingParams

pytest.importorskip("ts.metrics.metric_cache_yaml_impl")

from orcaserve.handler.metrics import EngineMetrics  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TAGGED = re.compile(r"\[METRICS\](orca_spec_\w+)\.\w+:([\d.]+)\|#[^|]*Method:([^,|]+)")


def test_spec_counters_go_out_from_the_snapshot(engine_for, metrics_cache, caplog):
    engine = engine_for(tiny_model("llama"), max_num_seqs=8, max_num_batched_tokens=64, speculative=NGRAM)
    engine.spec.policy.observe_step = lambda shape, seconds: None  # every eligible row speculates, whatever the load
    metrics = EngineMetrics(metrics_cache, "tiny")
    first = engine.snapshot()
    assert first.spec is not None and first.spec.proposed == 0
    with caplog.at_level(logging.INFO):
        for i in range(4):
            prompt = ([9 + i, 10, 11 + i, 12] * 12)[: 30 + i]
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
    live = engine.spec.stats
    assert live.proposed > live.accepted > 0
    assert first.spec.proposed == 0  # a snapshot is a copy: later steps do not change it
    series: dict[str, float] = {}
    for m in map(TAGGED.search, caplog.messages):
        if m:
            assert m.group(3) == "ngram"
            name = m.group(1)
            series[name] = float(m.group(2)) if name.endswith("length") else series.get(name, 0.0) + float(m.group(2))
    assert series["orca_spec_proposed_tokens_total"] == live.proposed
    assert series["orca_spec_accepted_tokens_total"] == live.accepted
    assert series["orca_spec_steps_on_total"] == live.steps_on
    assert series["orca_spec_mean_accepted_length"] == pytest.approx(live.mean_accepted_length, abs=1e-4)


def test_no_spec_series_without_speculation(engine_for, metrics_cache, caplog):
    engine = engine_for(tiny_model("llama"))
    metrics = EngineMetrics(metrics_cache, "tiny")
    with caplog.at_level(logging.INFO):
        engine.add_request("r", [9, 10, 11, 12] * 8, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
    assert engine.snapshot().spec is None
    assert not any("orca_spec_" in m for m in caplog.messages)

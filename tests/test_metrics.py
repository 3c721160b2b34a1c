"""Engine metrics as TorchServe's backend emits them: how often, and that counters add up."""

from __future__ import annotations

import logging
import re

import pytest
from tiny_models import TINY_VOCAB, tiny_model

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
            metrics.on_step(engine)
            steps += 1
    emitted = [(m.group(1), float(m.group(2))) for m in map(LINE.search, caplog.messages) if m]
    running = [v for name, v in emitted if name == "orca_num_requests_running"]
    assert steps > 10 and 1 <= len(running) < steps / 2
    assert running[-1] == 0  # the idle state, emitted although the previous emission was just now
    tokens = sum(v for name, v in emitted if name == "orca_generation_tokens_total")
    assert tokens == engine.stats.generation_tokens == 6 * 24
    assert sum(v for name, v in emitted if name == "orca_steps_total") == engine.stats.num_steps == steps

"""The serve benchmark's engine counters: read from TorchServe's Prometheus page (its own label
spelling), summed over label sets, and the measured load's steps and tokens per step."""

from __future__ import annotations

import pytest

from orcaserve.bench.serve import engine_counts

PAGE = """# HELP orca_steps_total engine steps
# TYPE orca_steps_total counter
orca_steps_total{ModelName="smollm2",Level="Model",Hostname="h",} 300.0
orca_step_tokens_total{ModelName="smollm2",Level="Model",Hostname="h",} 20000.0
orca_generation_tokens_total{ModelName="smollm2",Level="Model",Hostname="h",} 7000.0
orca_generation_tokens_total{ModelName="other",Level="Model",Hostname="h",} 29.0
orca_steps_total_bucket{le="1"} 5.0
orca_num_requests_running{ModelName="smollm2",Level="Model",Hostname="h",} 32.0
ts_inference_requests_total{model_name="smollm2",} 200.0
"""


def test_counters_are_read_and_summed_over_label_sets():
    got = engine_counts.parse(PAGE)
    assert got == {
        "orca_steps_total": 300.0,
        "orca_step_tokens_total": 20000.0,
        "orca_generation_tokens_total": 7029.0,
        "orca_preemptions_total": 0.0,  # not sent yet: none
    }


def test_the_loads_steps_per_token_and_tokens_per_step():
    before = engine_counts.parse(PAGE)
    after = dict(before)
    after.update(orca_steps_total=554.0, orca_step_tokens_total=39660.0, orca_generation_tokens_total=13458.0)
    d = engine_counts.delta(before, after)
    assert d["steps"] == 254 and d["generation_tokens"] == 6429 and d["preemptions"] == 0
    assert d["steps_per_output_token"] == pytest.approx(254 / 6429)
    assert d["tokens_per_step"] == pytest.approx(19660 / 254)
    assert "254 steps, 6429 tokens generated, 0.0395 steps per output token, 77.4 tokens" in engine_counts.line(d)
    assert engine_counts.line(engine_counts.delta(before, before)) == "engine counters: no step counted"

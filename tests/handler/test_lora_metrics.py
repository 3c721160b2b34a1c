"""LoRA adapters' metrics as TorchServe's backend emits them (handler/lora_metrics.py): per adapter
the requests and the tokens computed under it, the adapters loaded and stacked, and the slot swaps
and evictions, the counters' increments adding up to the engine's totals."""

from __future__ import annotations

import logging
import re

import pytest
from lora_adapters import make_adapter

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.scheduler import SamplingParams

pytest.importorskip("ts.metrics.metric_cache_yaml_impl")

from orcaserve.handler.metrics import EngineMetrics  # noqa: E402

LINE = re.compile(r"\[METRICS\](orca_lora_\w+)\.\w+:([\d.]+)\|#([^|]*)")


def test_lora_series_go_out_from_the_snapshot(engine_for, metrics_cache, caplog, tmp_path):
    base = tiny_family("LlamaForCausalLM")
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(base, tmp_path / name, seed=seed, r=4, alpha=8)
    paths = {n: str(tmp_path / n) for n in "ab"}
    engine = engine_for(base, lora_adapters=paths, max_loras=1, max_num_seqs=4)
    metrics = EngineMetrics(metrics_cache, "tiny")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.INFO):
        for i, lora in enumerate(["a", "b", "a", None]):
            engine.add_request(f"r{i}", [5 + i, 6, 7], params, lora=lora)
        while engine.has_unfinished():
            engine.step()
            metrics.on_step(engine.snapshot())
        engine.loras.remove("b")
        metrics.on_step(engine.snapshot())
    totals: dict[tuple[str, str], float] = {}
    for m in map(LINE.search, caplog.messages):
        if m:
            adapter = re.search(r"Adapter:([^,]+)", m.group(3))
            key = (m.group(1), adapter.group(1) if adapter else "")
            gauge = m.group(1).startswith("orca_lora_adapters_")
            totals[key] = float(m.group(2)) if gauge else totals.get(key, 0.0) + float(m.group(2))
    assert totals[("orca_lora_requests_total", "a")] == 2 and totals[("orca_lora_requests_total", "b")] == 1
    assert totals[("orca_lora_tokens_total", "a")] == 2 * (3 + 3)  # the prompt and 3 fed-back tokens each
    assert totals[("orca_lora_tokens_total", "b")] == 3 + 3
    assert totals[("orca_lora_adapters_loaded", "")] == 1  # "b" unloaded
    assert totals[("orca_lora_unloads_total", "")] == 1
    stats = engine.snapshot().lora
    # "r2" (of "a", stacked) passed "r1", which waited for the slot: "b" then evicted "a" once.
    assert stats is not None and stats.evictions == 1 and totals[("orca_lora_evictions_total", "")] == stats.evictions
    assert totals[("orca_lora_host_evictions_total", "")] == stats.host_evictions == 0  # max_cpu_loras holds both
    assert totals[("orca_lora_rereads_total", "")] == stats.rereads == 0
    assert totals[("orca_lora_swaps_total", "")] == stats.swaps

"""`orcaserve-bench lora`: the random adapters it writes are read by the engine's own loader at
the base model's shapes (every projection of every layer), and its traffic shapes pick as named."""

from __future__ import annotations

import torch

from orcaserve.bench.engine.lora import pick, write_adapter
from orcaserve.bench.models.tiny import tiny_family
from orcaserve.scheduler.lora.adapter import TARGETS, ModuleShapes, load_adapter


def test_the_benchmarks_adapters_load_at_the_base_models_shapes(tmp_path):
    base = tiny_family("LlamaForCausalLM")
    write_adapter(tmp_path / "a", base.config, rank=4, seed=0)
    shapes = ModuleShapes.of(base)
    adapter = load_adapter("a", str(tmp_path / "a"), shapes, 16, torch.float32, torch.device("cpu"))
    assert adapter.rank == 4 and adapter.modules == frozenset(TARGETS)
    assert len(adapter.weights) == shapes.num_layers * len(TARGETS)


def test_traffic_shapes():
    names = [f"a{i}" for i in range(4)]
    assert pick(names, "base", 3, 0) == [None] * 3
    assert pick(names, "uniform", 8, 0) == names * 2
    zipf = pick(names, "zipf", 400, 0)
    assert zipf.count("a0") > zipf.count("a3") > 0


def test_resident_memory_counts_the_stacked_copy(tmp_path):
    """What the benchmark reports per adapter: each adapter's weights and the stacked copy, padded
    to the largest rank, that a step of several adapters reads."""
    from orcaserve.scheduler.lora.resident import LoraSet

    base = tiny_family("LlamaForCausalLM")
    shapes = ModuleShapes.of(base)
    adapters = []
    for name, rank in (("a", 4), ("b", 2)):
        write_adapter(tmp_path / name, base.config, rank=rank, seed=rank)
        adapters.append(load_adapter(name, str(tmp_path / name), shapes, 16, torch.float32, torch.device("cpu")))
    loras = LoraSet(adapters, shapes, torch.float32, max_loras=2)  # both stacked at once
    own = sum(a.nbytes for a in adapters)
    padded = 2 * adapters[0].nbytes  # both stacked at rank 4
    assert loras.nbytes == own + padded


def test_run_load_counts_slot_evictions_and_swap_time(engine_for, tmp_path):
    """With fewer slots than adapters (`--max-loras`) the mixed run reports the LRU's evictions and
    the share of its time spent rewriting slots; the engine's own methods are back after it."""
    from orcaserve.bench.engine.lora import run_load

    base = tiny_family("LlamaForCausalLM")
    paths = {}
    for i in range(3):
        write_adapter(tmp_path / f"a{i}", base.config, rank=4, seed=i)
        paths[f"a{i}"] = str(tmp_path / f"a{i}")
    engine = engine_for(base, lora_adapters=paths, max_loras=1, max_num_seqs=4)
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    got = run_load(engine, prompts, ["a0", "a1", "a2", None, "a1", "a0"], clients=4, out_len=3)
    assert got["evictions"] > 0 and 0 < got["sync_share"] < 1 and got["steps_with_adapter"] > 0
    assert "step" not in vars(engine.runner.loras) and "sync" not in vars(engine.runner.loras)


def test_swap_cost_times_reads_and_swaps():
    from orcaserve.bench.engine.lora_swap import swap_cost

    threads = torch.get_num_threads()
    try:
        got = swap_cost(tiny_family("LlamaForCausalLM").config, 4, 3, 1, torch.float32, swaps=4)
    finally:
        torch.set_num_threads(threads)
    assert got["evictions"] == 4 and got["swap_ms"] > 0 and got["load_ms"] > 0

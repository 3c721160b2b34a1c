"""More LoRA adapters on the host than a step holds (`max_cpu_loras` > `max_loras`): the stacked
set changes by LRU between steps, the scheduler runs a request only once its adapter holds a slot
and never takes a slot from an adapter a running request uses, and the answers of requests whose
adapters were swapped in are token for token transformers + PEFT's. Adapters loaded and unloaded
while the engine serves (lora/runtime.py)."""

from __future__ import annotations

import random

import pytest
from lora_adapters import make_adapter, record_steps, run_mixed

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_family
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.errors import UnknownModel
from orcaserve.scheduler.lora.adapter import AdapterError
from orcaserve.scheduler.lora.slots import LoraSlots

# ---- the LRU itself ------------------------------------------------------------------------------


def test_free_slots_first_then_the_least_recently_used_adapter_not_in_use():
    slots = LoraSlots(2)
    assert slots.admit("a", set) and slots.admit("b", set)
    assert slots.names == ["a", "b"] and slots.num_evictions == 0
    assert slots.admit("a", set)  # a hit: "a" is now the most recently used
    assert slots.admit("c", set) and slots.names == ["a", "c"] and slots.num_evictions == 1  # "b" went
    assert slots.admit("b", lambda: {"c"}) and slots.names == ["b", "c"]  # "a" is LRU and free of requests


def test_an_adapter_a_running_request_uses_is_never_evicted():
    slots = LoraSlots(2)
    slots.admit("a", set)
    slots.admit("b", set)
    assert not slots.admit("c", lambda: {"a", "b", None})  # both busy: "c" waits
    assert slots.names == ["a", "b"] and "c" not in slots
    assert slots.admit("c", lambda: {"b"}) and slots.names == ["c", "b"]


def test_a_dropped_adapter_frees_its_slot():
    slots = LoraSlots(1)
    slots.admit("a", set)
    slots.drop("a")
    assert slots.names == [None] and slots.admit("b", lambda: {"a"}) and slots.num_evictions == 0


# ---- the engine ----------------------------------------------------------------------------------


def _three_adapters(base, tmp_path):
    a = make_adapter(base, tmp_path / "a", seed=1, r=8, alpha=16)
    b = make_adapter(base, tmp_path / "b", seed=2, r=4, alpha=8, rslora=True, targets=("q_proj", "v_proj", "down_proj"))
    c = make_adapter(base, tmp_path / "c", seed=3, r=16, alpha=16, targets=("o_proj", "gate_proj", "up_proj"))
    return {"a": a, "b": b, "c": c}, {n: str(tmp_path / n) for n in "abc"}


def _work(seed: int, n: int, names: list[str | None]) -> list[tuple[str, list[int], int, str | None]]:
    rng = random.Random(seed)
    return [
        (
            f"r{i}",
            [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([3, 9, 30]))],
            rng.randint(3, 8),
            names[i % len(names)],
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_swapped_in_between_steps_match_peft(max_loras, engine_for, tmp_path, monkeypatch):
    base = tiny_family("LlamaForCausalLM")
    refs, paths = _three_adapters(base, tmp_path)
    work = _work(seed=max_loras, n=12, names=["a", "b", None, "c"])
    expected = {rid: hf_greedy(refs[lora] if lora else base, prompt, n) for rid, prompt, n, lora in work}
    engine = engine_for(base, max_num_seqs=6, max_num_batched_tokens=40, lora_adapters=paths, max_loras=max_loras)
    loras = engine.runner.loras
    assert len(loras.adapters) == 3 and len(loras.slots.names) == max_loras
    # Swapping reads nothing from disk: the adapters' files are not even readable any more.
    monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: pytest.fail("an adapter was read again"))
    steps = record_steps(engine)
    running_sets: list[set] = []
    step = engine.step

    def watched():
        outs = step()
        running_sets.append({r.lora for r in engine.scheduler.running.values()} - {None})
        return outs

    engine.step = watched  # type: ignore[method-assign]
    results = run_mixed(engine, work, per_step=3)
    for rid, prompt, _, lora in work:
        assert results[rid].output_token_ids == expected[rid], (rid, lora, len(prompt))
    assert loras.slots.num_evictions > 0, "no adapter was swapped"
    assert all(len(s.rows) <= max_loras for s in steps if s is not None)
    assert all(len(names) <= max_loras for names in running_sets), "more adapters running than slots"
    if max_loras == 2:
        assert any(s is not None and s.batch is not None for s in steps), "no step mixed two adapters"
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_base_request_behind_a_request_waiting_for_a_slot_runs_in_the_same_step(engine_for, tmp_path):
    """One slot, held by a running request of "a": a request of "b" waits for it, keeping its
    place, and the base request queued behind it is scheduled in the same step (no head-of-line
    blocking); "b" runs once "a" is done. Every answer is PEFT's."""
    base = tiny_family("LlamaForCausalLM")
    refs, paths = _three_adapters(base, tmp_path)
    engine = engine_for(base, max_num_seqs=4, max_num_batched_tokens=64, lora_adapters=paths, max_loras=1)
    prompt = [random.Random(4).randrange(3, TINY_VOCAB) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a1", prompt, params, lora="a")
    engine.step()
    engine.add_request("b1", prompt, params, lora="b")
    engine.add_request("base", prompt, params)
    engine.step()
    running = engine.scheduler.running
    assert "base" in running and "b1" not in running  # passed "b1", which keeps its place
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, ref in (("a1", refs["a"]), ("b1", refs["b"]), ("base", base)):
        assert finals[rid].output_token_ids == hf_greedy(ref, prompt, 6), rid


def test_load_and_unload_while_serving(engine_for, tmp_path):
    """An adapter loaded mid-run serves PEFT's tokens; one unloaded with requests in flight lets
    them finish, refuses new ones and is dropped after; the name loaded again with other weights
    serves the new weights (the prefix cache does not hand it the old K/V)."""
    base = tiny_family("Qwen2ForCausalLM")
    refs, paths = _three_adapters(base, tmp_path)
    other = make_adapter(base, tmp_path / "a2", seed=9, r=8, alpha=16)
    engine = engine_for(base, max_num_seqs=4, max_num_batched_tokens=32, enable_lora=True, max_loras=1, max_cpu_loras=2)
    reg = engine.loras
    assert engine.lora_names == []
    prompt = [random.Random(1).randrange(3, TINY_VOCAB) for _ in range(20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reg.add(reg.read("a", paths["a"]))
    engine.add_request("a1", prompt, params, lora="a")
    engine.add_request("base", prompt, params)
    for _ in range(2):
        engine.step()
    reg.add(reg.read("c", paths["c"]))  # while "a1" runs
    engine.add_request("c1", prompt, params, lora="c")
    engine.step()
    reg.remove("a")  # "a1" is still in flight
    with pytest.raises(UnknownModel):
        engine.add_request("a2", prompt, params, lora="a")
    with pytest.raises(AdapterError, match="unloading"):
        reg.add(reg.read("a", str(tmp_path / "a2")))
    assert "a" in engine.runner.loras.adapters
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a1"].output_token_ids == hf_greedy(refs["a"], prompt, 8)
    assert finals["c1"].output_token_ids == hf_greedy(refs["c"], prompt, 8)
    assert finals["base"].output_token_ids == hf_greedy(base, prompt, 8)
    engine.step()
    assert "a" not in engine.runner.loras.adapters and engine.lora_names == ["c"]
    reg.add(reg.read("a", str(tmp_path / "a2")))  # the name again, other weights
    engine.add_request("a3", prompt, params, lora="a")
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a3"].output_token_ids == hf_greedy(other, prompt, 8) != finals["a1"].output_token_ids
    assert reg.num_loads == 3 and reg.num_unloads == 1


def test_bad_adapters_at_run_time_are_refused_and_serving_goes_on(engine_for, tmp_path):
    base = tiny_family("LlamaForCausalLM")
    _, paths = _three_adapters(base, tmp_path)
    engine = engine_for(base, lora_adapters={"a": paths["a"]}, max_cpu_loras=2)
    reg = engine.loras
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        reg.read("x", str(tmp_path))
    with pytest.raises(AdapterError, match="rank 16 is above max_lora_rank=8"):
        engine_for(base, enable_lora=True, max_lora_rank=8).loras.read("c", paths["c"])
    with pytest.raises(AdapterError, match="adapter name 'a b'"):
        reg.read("a b", paths["b"])
    with pytest.raises(AdapterError, match="loaded already"):
        reg.add(reg.read("a", paths["b"]))
    reg.add(reg.read("b", paths["b"]))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("ra", [5, 6, 7], params, lora="a")
    engine.add_request("rb", [5, 6, 7], params, lora="b")
    with pytest.raises(AdapterError, match="max_cpu_loras=2 adapters are in host memory, each used by a request"):
        reg.add(reg.read("c", paths["c"]))  # both in use: neither may leave host memory
    with pytest.raises(UnknownModel):
        reg.remove("c")
    while engine.has_unfinished():
        engine.step()
    outs = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(outs[0].output_token_ids) == 3 and engine.lora_names == ["a", "b"]

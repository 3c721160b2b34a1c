"""More LoRA adapters served than host memory holds (`max_cpu_loras`): the least recently named
adapter no request in flight uses leaves host memory, and is read back from disk on a reader
thread, beside the step loop, when a request names it again; the answers stay token for token
transformers + PEFT's. An adapter whose files changed or vanished meanwhile is refused, failing
its waiting requests alone (docs/lora.md "More adapters than host memory holds")."""

from __future__ import annotations

import random
import shutil
import threading

from lora_adapters import make_adapter, run_mixed

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_family
from orcaserve.scheduler import SamplingParams


def _adapters(base, tmp_path, n=3):
    refs = {f"l{i}": make_adapter(base, tmp_path / f"l{i}", seed=i + 1, r=4 + 4 * (i % 2), alpha=8) for i in range(n)}
    return refs, {name: str(tmp_path / name) for name in refs}


def test_adapters_past_max_cpu_loras_are_read_back_from_disk_and_match_peft(engine_for, tmp_path):
    base = tiny_family("LlamaForCausalLM")
    refs, paths = _adapters(base, tmp_path)
    engine = engine_for(base, max_num_seqs=4, max_num_batched_tokens=40, lora_adapters=paths, max_cpu_loras=2)
    reg, loras = engine.loras, engine.runner.loras
    assert list(loras.adapters) == ["l0", "l1"] and engine.lora_names == ["l0", "l1", "l2"]  # l2 left on disk
    assert len(loras.slots.names) == 2  # max_loras defaults to what host memory holds
    read, threads = reg.read, []

    def watched(name, path):
        threads.append(threading.current_thread().name)
        return read(name, path)

    reg.read = watched  # type: ignore[method-assign]
    host_sizes: list[int] = []
    step = engine.step

    def stepped():
        host_sizes.append(len(loras.adapters))
        return step()

    engine.step = stepped  # type: ignore[method-assign]
    rng = random.Random(5)
    names = ["l2", None, "l0", "l1", "l2", "l0", None, "l1"]
    work = [
        (f"r{i}", [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([4, 11]))], rng.randint(3, 6), lora)
        for i, lora in enumerate(names)
    ]
    results = run_mixed(engine, work, per_step=1)
    for rid, prompt, n, lora in work:
        assert results[rid].output_token_ids == hf_greedy(refs[lora] if lora else base, prompt, n), (rid, lora)
    assert reg.num_rereads >= 1 and reg.num_host_evictions >= 1
    assert threads and all(t.startswith("lora-read") for t in threads), threads  # never on the step loop
    assert max(host_sizes) <= 2
    stats = engine.snapshot().lora
    assert stats is not None and stats.rereads == reg.num_rereads and stats.host_evictions == reg.num_host_evictions
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_an_adapter_changed_on_disk_is_refused_and_the_others_keep_serving(engine_for, tmp_path):
    base = tiny_family("Qwen2ForCausalLM")
    refs, paths = _adapters(base, tmp_path)
    engine = engine_for(base, max_num_seqs=4, max_num_batched_tokens=40, lora_adapters=paths, max_cpu_loras=1)
    assert list(engine.runner.loras.adapters) == ["l0"]
    shutil.rmtree(paths["l1"])
    make_adapter(base, tmp_path / "l1", seed=77, r=8, alpha=8)  # other weights under the same path
    shutil.rmtree(paths["l2"])  # gone
    prompt = [random.Random(2).randrange(3, TINY_VOCAB) for _ in range(9)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for rid, lora in (("changed", "l1"), ("gone", "l2"), ("base", None)):
        engine.add_request(rid, prompt, params, lora=lora)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["changed"].finish_reason == "error" and "changed since it was loaded" in finals["changed"].error
    assert finals["gone"].finish_reason == "error" and "l2" in finals["gone"].error
    assert finals["base"].output_token_ids == hf_greedy(base, prompt, 4)
    engine.add_request("l0", prompt, params, lora="l0")  # l0 stayed in host memory, still served
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["l0"].output_token_ids == hf_greedy(refs["l0"], prompt, 4)


def test_prompt_logprobs_of_an_adapter_on_disk_are_refused_never_run_without_it(engine_for, tmp_path):
    """A prompt's log-probabilities run at once, outside the queue: an adapter still on disk fails
    that request with the reason; the read it started serves the next one."""
    base = tiny_family("LlamaForCausalLM")
    _, paths = _adapters(base, tmp_path, n=2)
    engine = engine_for(base, lora_adapters=paths, max_cpu_loras=1)
    reg, go = engine.loras, threading.Event()
    read = reg.read
    reg.read = lambda name, path: go.wait(60) and read(name, path)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    engine.add_request("early", [5, 6, 7, 8], params, lora="l1")  # starts the read, held until `go`
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["early"].finish_reason == "error" and "read back from disk" in finals["early"].error
    go.set()
    while "l1" not in engine.runner.loras.adapters:
        engine.step()
    engine.add_request("later", [5, 6, 7, 8], params, lora="l1")
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["later"].finish_reason == "length" and len(finals["later"].prompt_logprobs) == 4

"""Asynchronous scheduling (docs/host-overlap.md) gives exactly the synchronous engine's outputs:
the real tiny model on the CPU, and the stub device of benchmarks/engine/host_overhead.py, which sleeps
without the GIL as a GPU step does."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from orcaserve.bench.engine import host_overhead
from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.structured_outputs import StructuredOutputs

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers x K,V x 16 slots x 2 KV heads x 16 dims x fp32


def _drive(engine, requests, abort_after=None):
    """Add `requests` [(id, prompt, params)] three per step; every output of each request, in
    order. `abort_after` (id, k): abort that request once it has k outputs."""
    streams: dict[tuple[str, int], list] = {}
    pending, step = list(requests), 0
    while pending or engine.has_unfinished():
        if step % 2 == 0:
            for rid, prompt, params in pending[:3]:
                engine.add_request(rid, prompt, params)
            pending = pending[3:]
        for out in engine.step():
            streams.setdefault((out.request_id, out.index), []).append(out)
        if abort_after is not None:
            rid, k = abort_after
            if len(streams.get((rid, 0), [])) == k:
                out = engine.abort(rid)
                streams[rid, 0].append(out)
                abort_after = None
        step += 1
    return streams


def _summary(streams):
    """Per request: the final output's fields, and what its stream delivered."""
    result = {}
    for key, outs in streams.items():
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        streamed = [t for o in outs for t in o.new_token_ids]
        text = "".join(o.new_text for o in outs)
        lps = final.logprobs
        result[key] = (
            final.output_token_ids,
            final.text,
            final.finish_reason,
            streamed,
            text,
            # to 4 places: the batches differ, and a row's last bits with them
            [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top]) for lp in lps]
            if lps is not None
            else None,
            final.prompt_logprobs is not None,
        )
    return result


def _workload(seed: int, stop: str | None) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]  # a prefix the cache serves
    kinds = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop] if stop else [], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(
            temperature=0.7, seed=5, max_tokens=40, structured_outputs=StructuredOutputs(choice=["yes", "no"])
        ),
        SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[rng.randrange(3, TINY_VOCAB)]),
    ]
    work = []
    for i in range(18):
        prefix = shared if i % 3 == 0 else []
        prompt = prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 60))]
        work.append((f"r{i}", prompt, kinds[i % len(kinds)]))
    return work


@pytest.mark.parametrize("policy", ["fcfs", pytest.param("fair", marks=pytest.mark.slow)])  # fair: full suite only
def test_real_model_async_matches_sync(engine_for, policy):
    """Greedy and seeded sampling, n > 1, logprobs, prompt logprobs, a stop string, penalties,
    structured outputs, stop tokens, the prefix cache and preemption (a small KV pool)."""
    model = tiny_model("llama")
    args = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory=14 * BLOCK_BYTES,
        scheduling_policy=policy,
    )
    # A stop string from a greedy answer, so that it is met mid-answer.
    probe = engine_for(model, **args).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30))[0]
    stop = probe.text[len(probe.text) // 2 :][:3] or None
    work = _workload(0, stop)
    sync = engine_for(model, async_scheduling=False, **args)
    asyn = engine_for(model, async_scheduling=True, **args)
    expected = _summary(_drive(sync, work))
    got = _summary(_drive(asyn, work))
    assert got == expected
    # The tenants are charged the same tokens: a token dropped a step late is never charged.
    charged = [(t.prompt_tokens, t.output_tokens) for t in (e.scheduler.shares.get(None) for e in (sync, asyn))]
    assert charged[0] == charged[1] and charged[0][1] > 0
    assert asyn.stats.num_preemptions > 0 and sync.stats.num_preemptions > 0
    assert asyn.stats.prefix_cache_hits > 0


@pytest.mark.parametrize("on", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: full suite only
def test_final_only_output_is_the_streams_last(engine_for, on):
    """A FINAL_ONLY request gets its final output alone, the same in every field as the last
    output of the same request streamed (DELTA), its times aside (wall clock, set alike)."""
    model = tiny_model("llama")
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=14 * BLOCK_BYTES, async_scheduling=on)
    probe = engine_for(model, **args).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30))[0]
    work = _workload(1, probe.text[len(probe.text) // 2 :][:3] or None)
    delta = _drive(engine_for(model, **args), work)
    final_only = [(rid, prompt, dataclasses.replace(p, output_kind="final_only")) for rid, prompt, p in work]
    got = _drive(engine_for(model, **args), final_only)
    assert set(got) == set(delta) and len(delta) > len(work)  # every choice of every request
    for key, outs in got.items():
        assert len(outs) == 1 and outs[0].finished
        mine, streamed = dataclasses.asdict(outs[0]), dataclasses.asdict(delta[key][-1])
        times, streamed_times = mine.pop("times"), streamed.pop("times")
        assert mine == streamed
        assert [t is None for t in times.values()] == [t is None for t in streamed_times.values()]
    assert {o[0].finish_reason for o in got.values()} >= {"stop", "length"}


def test_abort_mid_stream(engine_for):
    model = tiny_model("llama")
    work = [(f"r{i}", [3 + i, 9, 11 + i], SamplingParams(temperature=0, max_tokens=30)) for i in range(4)]
    full = _summary(_drive(engine_for(model, async_scheduling=False), work))
    streams = _drive(engine_for(model, async_scheduling=True), work, abort_after=("r1", 5))
    aborted = streams["r1", 0]
    assert aborted[-1].finish_reason == "abort"
    tokens = [t for o in aborted for t in o.new_token_ids]
    assert tokens == aborted[-1].output_token_ids == full["r1", 0][0][: len(tokens)]
    assert 4 <= len(tokens) < 30
    for i in (0, 2, 3):
        assert _summary({("x", 0): streams[f"r{i}", 0]})["x", 0] == full[f"r{i}", 0]


def _stub_engine(tokenizer, on: bool, step_ms: float = 0.0):
    engine = host_overhead.build_engine(8, 64, tokenizer=tokenizer, async_scheduling=on)
    host_overhead.install_stub(engine, host_overhead.StubDevice(step_ms / 1e3))
    return engine


def test_stub_device_async_matches_sync(tokenizer):
    """The stub samples from each request's length, so both engines must give the same tokens,
    texts and finish reasons (stop strings, max_tokens, stop tokens), with the device's steps
    really overlapping the host's in the asynchronous one."""
    lengths = [40, 1, 2, 33, 40, 17, 40, 5, 40, 3, 28, 40]
    prompts = [[300, 301] if i % 2 else [310 + i, 4000] for i in range(len(lengths))]
    free = [(f"s{i}", p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
    probe = {k[0]: v for k, v in _summary(_drive(_stub_engine(tokenizer, False), free)).items()}
    work = []
    for i, (prompt, m) in enumerate(zip(prompts, lengths)):
        ids, text = probe[f"s{i}"][0], probe[f"s{i}"][1]
        stop = [text[len(text) // 2 :][:3]] if i % 3 == 0 else []  # met mid-answer
        stop_ids = [ids[m // 2]] if i % 3 == 1 else []
        work.append((f"s{i}", prompt, SamplingParams(max_tokens=m, stop=stop, stop_token_ids=stop_ids)))
    expected = _summary(_drive(_stub_engine(tokenizer, False, 1.0), work))
    got = _summary(_drive(_stub_engine(tokenizer, True, 1.0), work))
    assert got == expected
    assert any(v[2] == "stop" for v in got.values()) and any(v[2] == "length" for v in got.values())


def test_stub_sampler_reads_lengths_from_step_buffers(tokenizer):
    """The stub samples from the step's arrays (its rows' `seq_lens`); each id is still the one
    its request's own length and id give, in steps mixing prompt chunks and decodes."""
    import zlib

    engine = _stub_engine(tokenizer, False)
    sampler = engine.sampler
    seen: list[tuple[list[int], list[int]]] = []
    sample = sampler.sample

    def spy(logits, reqs):
        ids = sample(logits, reqs).tolist()
        seen.append(
            (ids, [300 + (len(r.all_token_ids) * 7919 + zlib.crc32(r.request_id.encode())) % 20000 for r in reqs])
        )
        return torch.tensor(ids)

    sampler.sample = spy
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i, n in enumerate([3, 40, 1, 17]):
        engine.add_request(f"b{i}", [300 + i] * n, params)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert len(seen) > 4 and all(got == want for got, want in seen)


def test_host_overhead_benchmark_smoke(tokenizer, monkeypatch):
    """The benchmark runs end to end (no timing asserted)."""
    monkeypatch.setattr(host_overhead, "smollm2_tokenizer", lambda: tokenizer)
    import argparse

    parser = argparse.ArgumentParser()
    host_overhead.add_arguments(parser)
    result = host_overhead.run(
        parser.parse_args(["--seqs", "4", "--device-ms", "1", "--overlap-seqs", "4", "--steps", "3"])
    )
    assert set(result["host_per_step"]) == {"sync", "async"}
    assert set(result["overlap"]["async"]) == {"1.0"}


def test_engine_loop_streams_with_async_scheduling(engine_for):
    """The serving loop over an asynchronous engine: streams from threads end with every block
    back in the pool and the in-flight step drained."""
    import threading

    from orcaserve.bench.models.tiny import hf_greedy
    from orcaserve.scheduler import EngineLoop

    model = tiny_model("llama")
    loop = EngineLoop(engine_for(model, max_num_seqs=4, async_scheduling=True)).start()
    try:
        prompts = [[3 + i] * (4 + 7 * i) for i in range(6)]
        results: dict[int, list] = {}

        def client(i: int) -> None:
            stream = loop.submit(
                EngineRequest(f"t{i}", prompts[i], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            )
            results[i] = list(stream)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 6
        for i, outs in results.items():
            assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == hf_greedy(model, prompts[i], 8)
    finally:
        loop.shutdown()
    assert loop.engine.kv.pool.num_used == 0 and not loop.engine.has_unfinished()

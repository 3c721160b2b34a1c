"""Prefix caching through the real engine: greedy outputs are token-for-token the same with the
cache on and off (and as transformers'), over shared prefixes, chunked prefill, preemption,
aborts and salts; on tiny random models and on SmolLM2 (fp32 throughout)."""

from __future__ import annotations

import random

import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads, head dim 16, fp32


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def shared_prefix_workload(seed: int, n: int) -> list[tuple[list[int], int, str | None]]:
    """(prompt, output length, salt): three prefixes (two of them whole blocks long), suffixes of
    0 to 30 tokens (0: the same prompt again, so entirely cached), two salts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, TINY_VOCAB) for _ in range(k)] for k in (40, 48, 96)]
    work = []
    for _ in range(n):
        suffix = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([0, 0, 1, 7, 16, 30]))]
        work.append((rng.choice(prefixes) + suffix, rng.randint(3, 14), rng.choice([None, None, "other"])))
    return work


def run_staggered(engine, work, aborts: dict[int, str]) -> dict[str, object]:
    """Three arrivals every other step; `aborts`: step -> request id to abort then."""
    results, pending, step = {}, list(enumerate(work)), 0
    while pending or engine.has_unfinished():
        if step % 2 == 0:
            for i, (prompt, n, salt) in pending[:3]:
                engine.add_request(f"r{i}", prompt, greedy(n), cache_salt=salt)
            pending = pending[3:]
        if step in aborts and (out := engine.abort(aborts[step])) is not None:
            results[out.request_id] = out
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return results


@pytest.mark.parametrize("arch,backend", [("llama", None), ("qwen2", "torch")])
def test_shared_prefixes_match_with_cache_on_and_off(arch, backend, engine_for):
    model = tiny_model(arch)
    work = shared_prefix_workload(seed=3, n=30)
    aborts = {5: "r4", 9: "r13", 14: "r20"}
    args = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        kv_cache_memory=20 * BLOCK_BYTES,
        attention_backend=backend,
    )
    runs = {}
    for caching in (True, False):
        engine = engine_for(model, enable_prefix_caching=caching, **args)
        runs[caching] = run_staggered(engine, work, aborts)
        assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
        if caching:
            stats = engine.stats
            assert stats.prefix_cache_hits > 0.4 * stats.prefix_cache_queries, (
                stats.prefix_cache_hits,
                stats.prefix_cache_queries,
            )
            assert engine.kv.pool.num_cached_free > 0 and stats.kv_blocks_cached_free > 0
    on, off = runs[True], runs[False]
    assert any(o.finish_reason == "abort" for o in on.values())
    assert any(o.num_cached_tokens for o in on.values()) and not any(o.num_cached_tokens for o in off.values())
    for i, (prompt, n, _) in enumerate(work):
        rid = f"r{i}"
        if rid in aborts.values():  # the cache may let it finish before its abort: compare nothing
            continue
        assert on[rid].output_token_ids == off[rid].output_token_ids == hf_greedy(model, prompt, n), rid
        assert on[rid].num_cached_tokens <= (len(prompt) - 1) // 16 * 16


def test_cached_tokens_are_the_prefix_full_blocks_and_salts_isolate(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=256, block_size=16)
    rng = random.Random(5)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(50)]  # 3 full blocks + 2 tokens
    first = engine.generate([prefix + [7, 8]], greedy(6))[0]
    assert first.num_cached_tokens == 0

    def one(rid, prompt, salt=None):
        engine.add_request(rid, prompt, greedy(6), cache_salt=salt)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
        assert all(o.num_cached_tokens == outs[0].num_cached_tokens for o in outs)  # on every output
        assert outs[-1].output_token_ids == hf_greedy(model, prompt, 6)
        return outs[-1].num_cached_tokens

    assert one("same-prefix", prefix + [9, 10, 11]) == 48
    assert one("same-prompt", prefix + [7, 8]) == 48  # 52 tokens: the block of the last is recomputed
    assert one("block-aligned", prefix[:48]) == 32  # all 3 blocks cached; the last one is recomputed
    assert one("other-salt", prefix + [7, 8], salt="tenant-b") == 0
    assert one("other-salt-again", prefix + [7, 8], salt="tenant-b") == 48
    assert one("no-salt-still", prefix + [9], salt=None) == 48
    with pytest.raises(ValueError, match="^cache_salt"):
        engine.add_request("bad", prefix, greedy(2), cache_salt=b"x")  # type: ignore[arg-type]


def test_requests_sharing_a_prefix_while_running(engine_for):
    """A second request joins while the first still decodes: it reads the first one's blocks
    (reference count 2) and both answer exactly."""
    model = tiny_model("qwen2")
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=32, block_size=16)
    prompt = [random.Random(9).randrange(3, TINY_VOCAB) for _ in range(70)]
    engine.add_request("a", prompt, greedy(20))
    outs = {}
    for step in range(40):
        if step == 4:  # a's prompt (3 chunks of 32) is computed by now and a decodes
            engine.add_request("b", prompt + [3, 4], greedy(10))
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["b"].num_cached_tokens == 64
    assert outs["a"].output_token_ids == hf_greedy(model, prompt, 20)
    assert outs["b"].output_token_ids == hf_greedy(model, prompt + [3, 4], 10)


@pytest.mark.slow
def test_smollm2_shared_system_prompt_on_and_off(smollm2_path, tokenizer):
    """The real default model: chat prompts behind one long system prompt, chunked prefill, a
    pool small enough to preempt, one abort; the answers are the same with the cache on and off."""
    import copy

    import torch

    from orcaserve.scheduler import Engine
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(smollm2_path, torch.float32, torch.device("cpu"))
    system = (
        "You are a careful assistant for a travel company. Answer briefly and politely, in plain "
        "English, without lists. If you do not know, say so. "
    ) * 3
    questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "What is 2 + 2?",
        "Where is the Eiffel Tower?",
        "What is the capital of France?",
        "Say hello.",
        "Which ocean is the largest?",
        "Name a fruit.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in questions
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    layers, kv_heads, head_dim = 30, 3, 64
    block_bytes = 2 * layers * 16 * kv_heads * head_dim * 4
    runs = {}
    for caching in (True, False):
        engine = Engine.from_model(
            copy.deepcopy(model),
            tokenizer,
            max_num_seqs=8,
            max_num_batched_tokens=96,
            kv_cache_memory=14 * block_bytes,
            dtype="float32",
            enable_prefix_caching=caching,
        )
        outs = {}
        for i, p in enumerate(ids):
            engine.add_request(f"q{i}", p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            for _ in range(2):  # staggered: each joins a running batch
                outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.abort("q5")
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        outs.pop("q5", None)
        runs[caching] = (outs, engine.stats.num_preemptions, engine.stats.prefix_cache_hits)
    (on, preempted_on, hits), (off, _, _) = runs[True], runs[False]
    assert hits > 0 and preempted_on > 0, (hits, preempted_on)
    assert len(on) == len(off) == 7
    for rid in on:
        assert on[rid].output_token_ids == off[rid].output_token_ids, (rid, on[rid].text, off[rid].text)
    assert "Paris" in on["q0"].text and on["q4"].num_cached_tokens > 0

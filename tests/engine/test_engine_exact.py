"""Greedy outputs of the iteration-level engine are token-for-token those of transformers."""

from __future__ import annotations

import functools
import random

import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams


def _workload(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 33, 300, 129] + [rng.randint(1, 300) for _ in range(n - 9)]
    return [([rng.randrange(3, TINY_VOCAB) for _ in range(length)], rng.randint(4, 24)) for length in lengths]


@functools.cache
def _expected(arch: str) -> list[list[int]]:
    """transformers' answers to `_workload(1, 24)`, computed once per model for both policies."""
    model = tiny_model(arch)
    return [hf_greedy(model, prompt, n) for prompt, n in _workload(seed=1, n=24)]


@pytest.mark.parametrize("arch, policy", [("llama", "fcfs"), ("qwen2", "fcfs"), ("llama", "fair"), ("qwen2", "fair")])
def test_staggered_chunked_preempted_requests_match_transformers(arch, policy, engine_for):
    """Under `fair` the requests belong to three tenants, one of weight 2: other batches, other
    chunks, other victims, the same tokens."""
    model = tiny_model(arch)
    work = _workload(seed=1, n=24)
    expected = _expected(arch)

    # 48 blocks x 16 slots: far less than the 24 requests need together, so decodes run out of
    # blocks and preempt; a 64-token budget splits every long prompt into chunks.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    engine = engine_for(
        model,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        kv_cache_memory=48 * block_bytes,
        scheduling_policy=policy,
        tenant_weights={"t0": 2},
    )
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    results, pending, step = {}, list(enumerate(work)), 0
    chunked = False
    while pending or engine.has_unfinished():
        # Staggered arrivals: three new requests every other step.
        if step % 2 == 0:
            for i, (prompt, n) in pending[:3]:
                engine.add_request(f"r{i}", prompt, params(n), tenant=f"t{i % 3}")
            pending = pending[3:]
        sched_before = engine.stats.num_steps
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        chunked |= engine.stats.last_step_tokens == 64 and engine.stats.num_steps > sched_before
        step += 1

    assert engine.stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert chunked, "the token budget was meant to force chunked prefill"
    for i, (prompt, n) in enumerate(work):
        out = results[f"r{i}"]
        assert out.output_token_ids == expected[i], f"request {i} (prompt {len(prompt)} tokens)"
        assert out.finish_reason == "length"
        assert out.prompt_tokens == len(prompt) and out.completion_tokens == n
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_generate_keeps_prompt_order_and_accepts_text(engine_for, tokenizer):
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [[7] * 40, [9, 10], "a b c", [11] * 5]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        assert max(ids) < TINY_VOCAB
        assert out.output_token_ids == hf_greedy(model, ids, 6)
        assert out.text == tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path, tokenizer):
    """The real default model: 8 chat prompts, 32 greedy tokens each, batched vs one at a time."""
    import copy

    import torch

    from orcaserve.bench.gpu.exact import QUESTIONS as questions
    from orcaserve.scheduler import Engine
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(smollm2_path, torch.float32, torch.device("cpu"))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    expected = []
    for p in ids:
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)
        gen = out[0, len(p) :].tolist()
        expected.append(gen[: gen.index(2) + 1] if 2 in gen else gen)  # generate stops at EOS

    engine = Engine.from_model(
        copy.deepcopy(model), tokenizer, max_num_seqs=8, max_num_batched_tokens=128, dtype="float32"
    )
    outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=32))
    for q, exp, out in zip(questions, expected, outs):
        assert out.output_token_ids == exp, q
    assert "Paris" in outs[0].text


def test_padded_token_counts():
    """CPU steps run their GEMMs at few row counts (oneDNN compiles a kernel per count): decode
    batches up to 32 as they are, larger steps at the next multiple of 8 rows in fp32, of 16 in
    bf16 (the token-exact tests above run through the padding)."""
    import torch

    from orcaserve.scheduler.model.row_padding import PAD_MULTIPLE, padded_tokens

    ts = (1, 7, 32, 33, 40, 41, 500, 512)
    assert [padded_tokens(t, PAD_MULTIPLE[torch.float32]) for t in ts] == [1, 7, 32, 40, 40, 48, 504, 512]
    assert [padded_tokens(t, PAD_MULTIPLE[torch.bfloat16]) for t in ts] == [1, 7, 32, 48, 48, 48, 512, 512]

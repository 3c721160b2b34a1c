"""What the speculative-decoding tests share (tests/engine/test_speculative.py, test_spec_draft.py):
a workload of prompts that repeat themselves and random ones, run with staggered arrivals, and an
engine whose speculation policy speculates on every eligible row."""

from __future__ import annotations

import copy
import random

import torch

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy
from orcaserve.scheduler import SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x slots x KV heads x head dim x fp32, tiny models


def speculating(engine):
    """`engine` with its speculation policy kept in its learning phase, where every eligible row
    speculates: the cost model learns from measured step times, so on a loaded machine it may
    decline a different share of steps from run to run, and these tests check exactness with as
    many speculated rows as the rows allow (the policy's own choices: test_spec_sampler.py)."""
    engine.spec.policy.observe_step = lambda shape, seconds: None
    return engine


def spec_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds its n-grams) and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(2, 90))])
        else:
            unit = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(2, 9))]
            out.append((unit * 40)[: rng.randint(10, 120)])
    return out


def run_staggered(engine, work, params, stagger=True):
    """Every request to the end, three new ones every other step; outputs by request id, and the
    delta outputs of each."""
    final, deltas, pending, step = {}, {}, list(enumerate(work)), 0
    while pending or engine.has_unfinished():
        if not stagger or step % 2 == 0:
            for i, prompt in pending[: 3 if stagger else len(pending)]:
                engine.add_request(f"r{i}", prompt, params(i))
            pending = pending[3 if stagger else len(pending) :]
        for out in engine.step():
            deltas.setdefault((out.request_id, out.index), []).append(out)
            if out.finished:
                final[(out.request_id, out.index)] = out
        step += 1
    return final, deltas


def on_equals_off_under_pressure(engine_for, model, speculative: dict, work: list[list[int]]):
    """Greedy `work` (lengths 8-40 tokens) with and without `speculative`, both equal to
    transformers' answer and streamed whole: 40 blocks of 16 slots, fewer than the requests
    together need, so decodes preempt; a 48-token budget chunks the long prompts beside speculated
    decodes. Returns the speculating engine."""
    lengths = [random.Random(i).randint(8, 40) for i in range(len(work))]
    params = lambda i: SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)  # noqa: E731
    args = dict(max_num_seqs=8, max_num_batched_tokens=48, kv_cache_memory=40 * BLOCK_BYTES)
    on = speculating(engine_for(model, speculative=speculative, **args))
    off = engine_for(model, **args)
    got, deltas = run_staggered(on, work, params)
    want, _ = run_staggered(off, work, params)
    for i, prompt in enumerate(work):
        out = got[(f"r{i}", 0)]
        assert out.output_token_ids == want[(f"r{i}", 0)].output_token_ids == hf_greedy(model, prompt, lengths[i])
        assert out.completion_tokens == lengths[i] and out.finish_reason == "length"
        streamed = [t for d in deltas[(f"r{i}", 0)] for t in d.new_token_ids]
        assert streamed == out.output_token_ids and "".join(d.new_text for d in deltas[(f"r{i}", 0)]) == out.text
    assert any(len(d.new_token_ids) > 1 for ds in deltas.values() for d in ds), "no output carried several tokens"
    assert on.stats.num_preemptions > 0
    return on


def draft_dir(tmp_path_factory, tokenizer, model, name: str) -> str:
    """`model` saved as a draft checkpoint beside the target's tokenizer."""
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def noised(model, scale: float, seed: int = 1):
    """A copy of `model` whose weights carry Gaussian noise: a draft that agrees with the target
    often, not always (both accepted runs and rejections)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return draft


def draft_setting(path: str, k: int = 4) -> dict:
    return {"method": "draft", "model": path, "num_speculative_tokens": k}

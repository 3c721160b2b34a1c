"""A draft model's proposals on sampled rows, checked by the general rejection rule
(docs/speculative-decoding.md "Exactness"): the first tokens it emits follow the target's exact
law over many seeds; a seeded request repeats itself; a draft equal to the target at temperature 1
has every proposal accepted, where the point-mass rule would accept the target's p(argmax)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from spec_workload import draft_dir, draft_setting, noised, spec_prompts, speculating

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.scheduler import SamplingParams

PROMPT = [306, 281, 69, 417, 12, 88, 301, 5]
TOP_K = 2  # target and draft keep their 2 most likely tokens: 8 outcomes for 3 tokens
SEEDS = 1200


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def noisy(target, tokenizer, tmp_path_factory):
    """A draft that often disagrees with the target's top tokens (accepted runs and rejections),
    and its checkpoint."""
    draft = noised(target, 0.05)
    return draft, draft_dir(tmp_path_factory, tokenizer, draft, "draft-noisy")


def _top_k_probs(model, tokens: list[int]) -> torch.Tensor:  # [V] the sampler's law at temperature 1
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    kept = logits.topk(TOP_K)
    return torch.zeros_like(logits).scatter_(0, kept.indices, kept.values.softmax(-1))


def _exact_law(model, second=None) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) after PROMPT, from the target's own next-token laws (t2's from `second`'s
    instead: what a wrong rule accepting every proposal would emit)."""
    law: dict[tuple[int, ...], float] = {}
    p1 = _top_k_probs(model, PROMPT)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = _top_k_probs(second or model, PROMPT + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = _top_k_probs(model, PROMPT + [t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                law[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return law


def _tv(counts: Counter, law: dict[tuple[int, ...], float], n: int) -> float:
    keys = set(counts) | set(law)
    return 0.5 * sum(abs(counts[k] / n - law.get(k, 0.0)) for k in keys)


def test_the_first_tokens_follow_the_targets_law(target, noisy, engine_for):
    """max_tokens 3, K = 1: t1 comes from the prefill, t2 and t3 from one verifying step (the
    proposal accepted and the bonus token, or the residual's draw and then a plain step). Over
    1,200 seeds the law of (t1, t2, t3) is within a bound from the sample size of the exact one:
    E[TV] <= 0.5 sqrt(m / N) for m outcomes, and TV exceeds its mean by t with probability at most
    exp(-2 N t^2) (McDiarmid), t for 1e-6."""
    engine = speculating(engine_for(target, max_num_seqs=64, speculative=draft_setting(noisy[1], 1)))
    counts: Counter = Counter()
    in_flight, nxt = 0, 0
    while nxt < SEEDS or in_flight:
        while in_flight < 31 and nxt < SEEDS:  # room for each decode's verifying rows
            params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, seed=nxt, ignore_eos=True)
            engine.add_request(f"s{nxt}", PROMPT, params)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                counts[tuple(out.output_token_ids)] += 1
                in_flight -= 1
    law = _exact_law(target)
    bound = 0.5 * math.sqrt(len(law) / SEEDS) + math.sqrt(math.log(1e6) / (2 * SEEDS))
    stats = engine.spec.stats
    assert stats.proposed > 0.9 * SEEDS and 0.1 * stats.proposed < stats.accepted < 0.9 * stats.proposed, stats
    assert _tv(counts, law, SEEDS) < bound
    # The test would see a wrong rule: one accepting every proposal emits t2 from the draft's law.
    wrong = _exact_law(target, second=noisy[0])
    assert sum(abs(wrong.get(k, 0.0) - law.get(k, 0.0)) for k in set(law) | set(wrong)) / 2 > bound


def _sampled_cases() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=12, n=2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.02, max_tokens=16, seed=13, logprobs=1),
        SamplingParams(temperature=1.0, max_tokens=16, seed=14, logit_bias={7: 3.0, 99: 2.0}, ignore_eos=True),
    ]


def test_a_seeded_request_repeats_itself(target, noisy, engine_for):
    """Twice on one engine and once on another: the same tokens, text and log-probabilities, with
    accepted runs and rejections between them. The prefix cache is off: a hit leaves a prompt one
    token to feed, a row that speculates where the first run's prefill did not (another schedule,
    other draws: the same distribution)."""
    work = spec_prompts(seed=5, n=2)
    args = dict(max_num_seqs=8, enable_prefix_caching=False, speculative=draft_setting(noisy[1], 4))
    first = speculating(engine_for(target, **args))
    again = speculating(engine_for(target, **args))
    for params in _sampled_cases():
        runs = [first.generate(work, params), first.generate(work, params), again.generate(work, params)]
        for a, b, c in zip(*runs):
            want = (a.output_token_ids, a.text, a.logprobs)
            assert (b.output_token_ids, b.text, b.logprobs) == want == (c.output_token_ids, c.text, c.logprobs)
    stats = first.spec.stats
    assert stats.accepted > 20 and stats.proposed > stats.accepted, stats
    assert not first.spec.proposer.num_requests and first.kv.pool.num_free == first.kv.pool.num_blocks


def test_a_draft_equal_to_the_target_has_all_sampled_proposals_accepted(
    target, tokenizer, tmp_path_factory, engine_for
):
    """p == q: min(1, p / q) = 1, every proposal is accepted (the point-mass rule on the draft's
    argmax accepts the target's p(argmax), its mean printed by the log-probabilities here)."""
    path = draft_dir(tmp_path_factory, tokenizer, target, "draft-self-sampled")
    engine = speculating(engine_for(target, max_num_seqs=8, speculative=draft_setting(path, 4)))
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=3, logprobs=1, ignore_eos=True)
    outs = engine.generate(spec_prompts(seed=7, n=4), params)
    stats = engine.spec.stats
    assert stats.proposed > 50 and stats.accepted == stats.proposed, stats
    assert stats.mean_accepted_length > 3.5
    point_mass = [math.exp(lp.top[0][1]) for out in outs for lp in out.logprobs]  # p(argmax) per token
    assert sum(point_mass) / len(point_mass) < 0.5

"""Latency classes change which tokens a step computes, never which tokens come out: greedy
outputs with targeted and untargeted requests mixed are token-for-token transformers'."""

from __future__ import annotations

import random

import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.errors import InvalidRequest

# Targets tight enough that the step is planned from them every iteration (and untargeted
# chunks shrink, untargeted decodes sit out), generous TTFT so nothing is refused.
CLASSES = {"tight": {"tpot_ms": 15, "ttft_ms": 60000}, "loose": {"tpot_ms": 60000}, "batch": {}}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_classes_mixed_keep_greedy_outputs_exact(policy, engine_for):
    model = tiny_model("llama")
    rng = random.Random(3)
    lengths = [1, 16, 17, 90, 200, 33] + [rng.randint(1, 200) for _ in range(10)]
    work = [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], rng.randint(4, 20)) for n in lengths]
    expected = [hf_greedy(model, prompt, n) for prompt, n in work]
    engine = engine_for(model, max_num_seqs=6, max_num_batched_tokens=48, scheduling_policy=policy, slo_classes=CLASSES)
    with pytest.raises(InvalidRequest, match="'gold'") as e:
        engine.add_request("bad", [5, 6], slo_class="gold")
    assert e.value.param == "slo_class"
    results, pending, step = {}, list(enumerate(work)), 0
    names = [None, *CLASSES]
    while pending or engine.has_unfinished():
        if step % 2 == 0:
            for i, (prompt, n) in pending[:2]:
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                engine.add_request(f"r{i}", prompt, params, tenant=f"t{i % 2}", slo_class=names[i % 4])
            pending = pending[2:]
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    for i, (prompt, _) in enumerate(work):
        assert results[f"r{i}"].output_token_ids == expected[i], f"request {i} (prompt {len(prompt)} tokens)"
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert engine.stats.slo["loose"].good == engine.stats.slo["loose"].requests > 0
    assert engine.scheduler.cost.coefficients is not None  # the cost model learned from the steps


def test_step_cost_model_fitted_while_classes_are_set(engine_for):
    """The step-cost model learns only while the engine has latency classes: given at
    construction, or set later (as `orcaserve-bench slo` does between its runs)."""
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32)
    assert engine.slo_classes == {} and not engine.scheduler.step_costs
    engine.slo_classes = CLASSES
    assert set(engine.slo_classes) == set(CLASSES) and engine.scheduler.step_costs
    engine.slo_classes = dict(engine.slo_classes)  # already checked: kept as they are
    assert engine.scheduler.step_costs
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.scheduler.cost.num_observed > 0
    engine.slo_classes = None
    assert engine.slo_classes == {} and not engine.scheduler.step_costs

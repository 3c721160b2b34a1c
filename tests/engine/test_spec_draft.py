"""Speculative decoding with a draft model (`method: draft`), greedy rows: speculation on equals off
token for token for two lean families, under concurrency, chunked prefills, prefix-cache hits and
preemption in a small KV pool, with stops and limits inside accepted runs and n = 2; a draft that
is the target itself has every proposal accepted; a draft that raises costs its step's speculation
only; every KV block of target and draft comes back; a draft with another vocabulary or tokenizer
is refused at load. Sampled rows: test_spec_draft_sampled.py."""

from __future__ import annotations

import copy

import pytest
from spec_workload import draft_dir, draft_setting, noised, on_equals_off_under_pressure, spec_prompts, speculating

from orcaserve.bench.models.tiny import TINY_CONFIG, hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams


def _all_back(engine) -> None:
    draft = engine.spec.proposer
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert draft.kv.pool.num_free == draft.num_blocks and draft.num_requests == 0
    assert not engine.spec._tracked


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_off_under_chunks_cache_hits_and_preemption(arch, engine_for, tokenizer, tmp_path_factory):
    model = tiny_model(arch)
    path = draft_dir(tmp_path_factory, tokenizer, noised(model, 0.01), f"draft-{arch}")
    work = spec_prompts(seed=3, n=15)
    work += [work[0] + [7, 8], work[1][:40]]  # prefix-cache hits on earlier prompts
    # In a pool too small for all, decodes preempt (their draft state is dropped, rebuilt by a
    # prefill of the draft); the draft's own prefills run in chunks of the step's 48 tokens.
    on = on_equals_off_under_pressure(engine_for, model, draft_setting(path), work)
    stats = on.spec.stats
    assert stats.method == "draft" and stats.accepted >= 20 and stats.proposed > stats.accepted, stats
    _all_back(on)


@pytest.fixture(scope="module")
def llama_and_self(tokenizer, tmp_path_factory):
    """The tiny Llama, and a draft checkpoint that is the very same model."""
    model = tiny_model("llama")
    return model, draft_dir(tmp_path_factory, tokenizer, model, "draft-self")


def test_the_target_as_its_own_draft_has_every_proposal_accepted(llama_and_self, engine_for):
    model, path = llama_and_self
    work = spec_prompts(seed=7, n=6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    on = speculating(engine_for(model, max_num_seqs=8, speculative=draft_setting(path)))
    got = on.generate(work, params)
    for prompt, out in zip(work, got):
        assert out.output_token_ids == hf_greedy(model, prompt, 30)
    stats = on.spec.stats
    assert stats.proposed > 50 and stats.accepted == stats.proposed, stats
    assert stats.mean_accepted_length > 2.5
    _all_back(on)


def test_stops_limits_and_n_choices_equal_off(llama_and_self, engine_for, tokenizer):
    model, path = llama_and_self
    prompt = ([306, 281, 69] * 20)[:57]
    off = engine_for(model)
    on = speculating(engine_for(model, speculative=draft_setting(path, 6)))
    tokens = off.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].output_token_ids
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 9, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t]) for t in sorted(set(tokens))[:6]]
    texts = [tokenizer.decode(tokens[i : i + 2]) for i in range(3, 20, 4)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop=[s]) for s in texts if s.strip()]
    cases += [SamplingParams(temperature=0, max_tokens=24, n=2, logprobs=2, ignore_eos=True)]
    for p in cases:
        want = off.generate([prompt], p)
        got = on.generate([prompt], p)
        for a, b in zip(want, got):
            assert (b.output_token_ids, b.text, b.finish_reason) == (a.output_token_ids, a.text, a.finish_reason), p
    assert on.spec.stats.accepted >= 30
    _all_back(on)


def test_a_draft_that_raises_costs_its_step_only(llama_and_self, engine_for):
    model, path = llama_and_self
    work = spec_prompts(seed=9, n=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    on = speculating(engine_for(model, speculative=draft_setting(path)))
    runner = on.spec.proposer.runner
    real, calls = runner.execute, [0]

    def flaky(sched, kv):
        calls[0] += 1
        if calls[0] in (3, 4):  # mid-step: after the draft's first position of a step
            raise RuntimeError("draft forward failed")
        return real(sched, kv)

    runner.execute = flaky
    got = on.generate(work, params)
    for prompt, out in zip(work, got):
        assert out.finish_reason == "length" and out.output_token_ids == hf_greedy(model, prompt, 20)
    assert on.spec.stats.failed_steps == 2 and on.spec.stats.accepted > 0
    _all_back(on)


def test_a_quantized_draft_takes_the_targets_int8_activations(llama_and_self, engine_for):
    """`speculative.quantization` given: the draft's codes run with the engine's int8 activations
    (as the target's do), and greedy rows still answer as speculation off."""
    model, path = llama_and_self
    work = spec_prompts(seed=5, n=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    quant = {"quantization": "int8", "activations": "int8"}
    off = engine_for(model, **quant)
    on = speculating(engine_for(model, **quant, speculative={**draft_setting(path), "quantization": "int8"}))
    assert on.spec.proposer.runner.decoder.lm_head.activations == "int8"
    for a, b in zip(off.generate(work, params), on.generate(work, params)):
        assert b.output_token_ids == a.output_token_ids
    assert on.spec.stats.accepted > 0
    _all_back(on)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(engine_for, tokenizer, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model("llama")
    small = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "vocab_size": 256})).eval()
    path = draft_dir(tmp_path_factory, tokenizer, small, "draft-vocab")
    with pytest.raises(ValueError, match="vocabulary has 256 tokens and the target's 512"):
        engine_for(model, speculative=draft_setting(path))
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<orcaserve-draft-only>"])
    path = draft_dir(tmp_path_factory, other, model, "draft-tokenizer")
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        engine_for(model, speculative=draft_setting(path))


def test_every_method_has_its_settings_and_a_proposer():
    """spec/config.py checks a method's settings from its table, spec/proposers.py builds it from
    the proposers' table: the two name the same methods."""
    from orcaserve.scheduler.spec.config import METHOD_KEYS
    from orcaserve.scheduler.spec.proposers import PROPOSERS

    assert set(METHOD_KEYS) == set(PROPOSERS) == {"ngram", "draft"}

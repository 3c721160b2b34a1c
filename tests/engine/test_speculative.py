"""Speculative decoding (prompt lookup) in the engine: speculation on equals off token for token
(greedy, and seeded sampling), beside chunked prefills, prefix-cache hits and preemption; stops
and limits inside an accepted run; outputs carrying several tokens; KV blocks given back; bad
settings refused at load."""

from __future__ import annotations

import pytest
from spec_workload import on_equals_off_under_pressure, spec_prompts, speculating

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.scheduler import EngineConfig, SamplingParams
from orcaserve.scheduler.errors import InvalidRequest

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_equals_off_and_transformers_under_chunks_cache_hits_and_preemption(arch, engine_for):
    model = tiny_model(arch)
    work = spec_prompts(seed=3, n=18)
    work += [work[0] + [7, 8], work[1][:40]]  # prefix-cache hits on earlier prompts
    on = on_equals_off_under_pressure(engine_for, model, NGRAM, work)
    stats = on.spec.stats
    assert stats.accepted >= 5 and stats.proposed > stats.accepted, stats
    # Each speculated row decided its first proposal; the positions' accepted add up to the total.
    assert stats.checked_at[0] == stats.speculated_rows and sum(stats.accepted_at) == stats.accepted, stats
    assert on.kv.pool.num_free == on.kv.pool.num_blocks and not on.spec._tracked


def test_stops_and_limits_inside_accepted_runs_end_where_off_would(engine_for, tokenizer):
    model = tiny_model("llama")
    prompt = ([306, 281, 69] * 20)[:57]
    off = engine_for(model)
    on = speculating(engine_for(model, speculative={**NGRAM, "num_speculative_tokens": 6}))
    full = off.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    tokens = full.output_token_ids
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 30)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t]) for t in sorted(set(tokens))]
    texts = [tokenizer.decode(tokens[i : i + 2]) for i in range(3, 20, 4)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop=[s]) for s in texts if s.strip()]
    for p in cases:
        a = off.generate([prompt], p)[0]
        b = on.generate([prompt], p)[0]
        assert (b.output_token_ids, b.text, b.finish_reason) == (a.output_token_ids, a.text, a.finish_reason), p
        assert b.completion_tokens == len(a.output_token_ids)
    assert on.spec.stats.accepted >= 10
    # the model's length limit inside a run
    short_off = engine_for(model, max_model_len=70)
    short_on = speculating(engine_for(model, max_model_len=70, speculative=NGRAM))
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = short_off.generate([prompt], p)[0], short_on.generate([prompt], p)[0]
    assert b.output_token_ids == a.output_token_ids and len(a.output_token_ids) == 70 - len(prompt)
    assert b.finish_reason == a.finish_reason == "length"
    for engine in (on, short_on):
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_n_choices_logprobs_and_seeded_sampling_equal_off(engine_for):
    model = tiny_model("qwen2")
    work = spec_prompts(seed=5, n=6)
    params = [
        SamplingParams(temperature=0, max_tokens=24, n=2, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=24, seed=11, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=24, seed=12, n=2, ignore_eos=True),
        SamplingParams(temperature=0.5, min_p=0.1, max_tokens=24, seed=13, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, logit_bias={45: 3.0}, ignore_eos=True),
        SamplingParams(temperature=0.3, max_tokens=24, seed=14, ignore_eos=True),
    ]
    on = speculating(engine_for(model, speculative=NGRAM))
    off = engine_for(model)
    got, want = on.generate(work, params), off.generate(work, params)
    for a, b in zip(want, got):
        assert b.output_token_ids == a.output_token_ids, (a.request_id, a.index)
        if a.logprobs is not None:
            assert b.logprobs is not None and [x.token_id for x in b.logprobs] == [x.token_id for x in a.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
                assert [t for t, _ in y.top] == [t for t, _ in x.top]
    assert on.spec.stats.accepted >= 3
    again = on.generate(work, params)  # a seeded request repeats itself
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in got]


def test_rows_that_do_not_speculate(engine_for):
    """A request that turns speculation off, and one with penalties (its rows after a proposal
    would need the proposal in its counts), go without proposals and answer as off."""
    model = tiny_model("llama")
    prompt = [9, 10, 11, 12] * 10
    off = engine_for(model)
    on = speculating(engine_for(model, speculative=NGRAM))
    for p in (
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
    ):
        assert on.generate([prompt], p)[0].output_token_ids == off.generate([prompt], p)[0].output_token_ids
    assert on.spec.stats.proposed == 0
    lowered = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=1)
    assert on.generate([prompt], lowered)[0].output_token_ids == off.generate([prompt], lowered)[0].output_token_ids
    assert 0 < on.spec.stats.proposed <= on.spec.stats.speculated_rows


def test_requests_the_policy_never_picked_leave_no_state(engine_for):
    """The proposer measures every eligible row's match before the policy decides; a request it then
    never picked is still forgotten when it finishes (a later request of the same id starts afresh)."""
    model = tiny_model("llama")
    on = speculating(engine_for(model, speculative=NGRAM))
    on.spec.policy.plan = lambda sched, candidates, kinds=None: []
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on.generate([[9, 10, 11, 12] * 10], p)
    assert on.spec.stats.proposed == 0 and not on.spec._tracked
    assert not on.spec.proposer._index and not on.spec.policy._rows


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "draft", "num_speculative_tokens": 4}, "speculative.model .* is required"),
        ({"method": "draft", "model": "x", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "speculative.method"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "speculative.lookahead"),
        ("ngram", "speculative must be a mapping"),
    ],
)
def test_bad_settings_are_refused_naming_them(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative=value)


def test_combinations_not_built_are_refused_at_load():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="CPU engine only"):
        EngineConfig(speculative=NGRAM, device="cuda", quantization=None)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 8}, max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


def test_only_the_gpu_checks_variable_lifts_the_device_refusal(monkeypatch):
    """docs/speculative-decoding.md "What is refused": the GPU check's `spec` step alone sets it."""
    from orcaserve.scheduler.spec.config import GPU_CHECK_ENV

    monkeypatch.setenv(GPU_CHECK_ENV, "true")  # only "1" counts
    with pytest.raises(ValueError, match="CPU engine only"):
        EngineConfig(speculative=NGRAM, device="cuda", quantization=None)
    monkeypatch.setenv(GPU_CHECK_ENV, "1")
    config = EngineConfig(speculative=NGRAM, device="cuda", quantization=None)
    assert not config.resolved_async_scheduling()  # null is off with speculation, on CUDA too
    assert EngineConfig(device="cuda", quantization=None).resolved_async_scheduling()


def test_speculation_with_lora_adapters_is_refused():
    """Not proven exact together: the engine's configuration refuses it before anything loads."""
    from orcaserve.scheduler.config import EngineConfig

    with pytest.raises(ValueError, match="lora_adapters"):
        EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 2}, lora_adapters={"a": "/nowhere"})

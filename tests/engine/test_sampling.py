"""Sampling parameters: validation, filters, penalties, seeds and stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.sampler import _apply_penalties, filter_logits


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("inf")),
        ("seed", "x"),
        ("stop", [""]),
        ("ignore_eos", "yes"),
        ("output_kind", "cumulative"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": "x"}).stop == ["x"]


def _req(params: SamplingParams, prompt=(1, 2), output=()) -> Request:
    r = Request(EngineRequest("r", list(prompt), params, arrival_time=0.0))
    for t in output:
        r.append_token(t)
    return r


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    r = _req(
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        prompt=[0, 1],
        output=[2, 2, 4],
    )
    _apply_penalties(logits, [r])
    # repetition (prompt + output: 0, 1, 2, 4): positive / 2, negative * 2
    # presence and frequency (output only: 2 twice, 4 once)
    expected = [1.0, -4.0, 0.5 - 0.5 - 0.5, 0.5, 1.5 - 0.5 - 0.25]
    assert logits[0].tolist() == pytest.approx(expected)


def test_filters_keep_what_they_should():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda p: torch.isfinite(filter_logits(logits.clone(), [p.top_k], [p.top_p], [p.min_p]))[0].tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.7)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.01)) == [True, False, False, False]
    assert keep(SamplingParams(min_p=0.4)) == [True, True, False, False]


def test_repetition_penalty_greedy_matches_transformers(engine_for):
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 5, 6]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5)
    engine = engine_for(model)
    out = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True)
    )
    assert out[0].output_token_ids == ref[0, len(prompt) :].tolist()


def test_top_k_one_is_greedy(engine_for):
    model = tiny_model("qwen2")
    engine = engine_for(model)
    out = engine.generate([[3, 4, 5]], SamplingParams(temperature=0.9, top_k=1, max_tokens=10, seed=1))
    assert out[0].output_token_ids == hf_greedy(model, [3, 4, 5], 10)


def test_seeded_request_is_independent_of_its_batch(engine_for):
    model = tiny_model("llama")
    target = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]

    alone = engine_for(model).generate([prompt], target)[0].output_token_ids

    engine = engine_for(model, max_num_seqs=17, max_num_batched_tokens=64)
    others = [
        SamplingParams(temperature=1.0, max_tokens=8 + i, seed=i if i % 2 else None, ignore_eos=True, min_p=0.05)
        for i in range(16)
    ]
    prompts = [[20 + i] * (3 + 7 * i) for i in range(8)] + [prompt] + [[40 + i] * (5 + i) for i in range(8)]
    params = others[:8] + [target] + others[8:]
    together = engine.generate(prompts, params)[8].output_token_ids
    assert together == alone
    assert len(set(alone)) > 3  # it really sampled


def test_stop_strings_and_stop_tokens(engine_for, tokenizer):
    model = tiny_model("llama")
    prompt = [21, 22, 23]
    base = engine_for(model).generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and text.index(stop) > 0

    engine = engine_for(model)
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            assert stop not in "".join(pieces)
            final = out
    assert final.finish_reason == "stop"
    assert final.text == text[: text.index(stop)] == "".join(pieces)

    third = base.output_token_ids[2]
    out = engine_for(model).generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third]))[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == base.output_token_ids[: base.output_token_ids.index(third) + 1]


def test_bad_requests_raise_and_the_engine_keeps_running(engine_for):
    model = tiny_model("llama")
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # (K, V) x layers x block_size x kv heads x head_dim x fp32
    engine = engine_for(model, kv_cache_memory=40 * block_bytes, max_num_seqs=4)
    assert engine.max_model_len == 40 * 16  # capped by the cache, below the model's 1024
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1], SamplingParams())
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].completion_tokens == 5


def test_abort_returns_blocks(engine_for):
    engine = engine_for(tiny_model("llama"))
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.pool.num_used > 0
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    assert engine.abort("a") is None
    assert math.isclose(engine.stats.kv_usage, engine.stats.kv_blocks_used / engine.stats.num_blocks)

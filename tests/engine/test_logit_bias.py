"""`logit_bias`: OpenAI's per-token additive bias, against transformers' own sequence bias."""

from __future__ import annotations

import pytest
import torch

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.handler.openai import protocol as P
from orcaserve.scheduler import SamplingParams


def test_greedy_with_bias_matches_transformers_beside_unbiased_requests(engine_for):
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    plain = [hf_greedy(model, p, 12) for p in prompts]
    # Ban the first request's first answer token; lift a token the second one emits late.
    biases = [{plain[0][0]: -100.0}, {plain[1][-1]: 4.5, plain[1][0]: -2.0}, {}]
    # transformers' SequenceBiasLogitsProcessor, on single tokens
    want = [
        hf_greedy(model, p, 12, sequence_bias={(t,): v for t, v in b.items()} or None) for p, b in zip(prompts, biases)
    ]
    assert want[0] != plain[0] and want[1] != plain[1]  # the biases change the answers

    engine = engine_for(model, max_num_seqs=3, max_num_batched_tokens=8)  # chunked prefill too
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=b) for b in biases]
    outs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == want


def test_sampled_request_is_forced_and_logprobs_stay_raw(engine_for):
    model = tiny_model("qwen2")
    prompt, forced = [3, 4, 5], 77
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0, logit_bias={forced: 100}
    )
    out = engine_for(model).generate([prompt], params)[0]
    assert out.output_token_ids == [forced] * 6
    with torch.inference_mode():
        raw = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)[forced].item()
    # The model's own log-probability of the forced token, not the biased one (about 0).
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-4) and raw < -1.0


def test_out_of_vocabulary_bias_is_refused_and_the_engine_keeps_running(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model)
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="^logit_bias"):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]


@pytest.mark.parametrize(
    "bias",
    [[1], {-1: 1.0}, {True: 1.0}, {"1": 1.0}, {1: 100.5}, {1: float("nan")}, {1: "2"}, {i: 1.0 for i in range(1025)}],
    ids=["list", "negative", "bool", "str-key", "range", "nan", "str-value", "too-many"],
)
def test_invalid_biases_name_the_field(bias):
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias=bias)


def test_openai_body_keys_become_token_ids():
    req = P.parse_request({"prompt": "x", "logit_bias": {"5": 10, "0012": -100.0}}, P.COMPLETIONS)
    assert req.params.logit_bias == {5: 10.0, 12: -100.0}
    assert P.parse_request({"prompt": "x", "logit_bias": {}}, P.COMPLETIONS).params.logit_bias == {}

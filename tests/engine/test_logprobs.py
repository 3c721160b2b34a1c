"""Log-probabilities (`SamplingParams.logprobs`): the engine's against transformers' own, and their
OpenAI shapes."""

from __future__ import annotations

import random

import pytest
import torch

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.handler.openai.logprobs import LogprobsRenderer
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.core.token_logprob import TokenLogprob


def _reference(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: [len(output), V]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0].float()  # [P + O - 1, V]
    return torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)


def _check(out_logprobs: list[TokenLogprob], output: list[int], ref: torch.Tensor, k: int) -> None:
    assert [lp.token_id for lp in out_logprobs] == output
    for pos, lp in enumerate(out_logprobs):
        row = ref[pos]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = row.topk(k).values.tolist() if k else []
        assert values == pytest.approx(want, abs=1e-4)
        for token, value in lp.top:  # ties may order ids differently; each id's value must hold
            assert value == pytest.approx(row[token].item(), abs=1e-4)


def test_greedy_logprobs_match_transformers_through_chunks_and_preemption(engine_for):
    model = tiny_model("llama")
    rng = random.Random(3)
    work = [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], m) for n, m in ((5, 12), (90, 9), (40, 16), (150, 7))]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    # 20 blocks for 4 requests needing 2-11 each: decodes run out and preempt; 48-token chunks.
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_memory=20 * block_bytes)
    ks = [0, 5, 20, 1]
    for i, ((prompt, m), k) in enumerate(zip(work, ks)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=k))
    engine.add_request("plain", work[0][0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    streamed: dict[str, list[TokenLogprob]] = {}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "plain":
                assert out.new_logprobs is None and out.logprobs is None
            else:
                streamed.setdefault(out.request_id, []).extend(out.new_logprobs or [])
                assert len(out.new_logprobs or []) == len(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    assert engine.stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    for i, ((prompt, m), k) in enumerate(zip(work, ks)):
        out = final[f"r{i}"]
        assert out.output_token_ids == hf_greedy(model, prompt, m)
        assert out.logprobs == streamed[f"r{i}"] and len(out.logprobs) == m
        _check(out.logprobs, out.output_token_ids, _reference(model, prompt, out.output_token_ids), k)


def test_logprobs_are_the_models_own_whatever_the_sampling(engine_for):
    """Temperature, filters and penalties pick the token; the reported log-probabilities stay
    those of the model's distribution (vLLM's `raw_logprobs`)."""
    model = tiny_model("qwen2")
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(3, 30))
    params = [
        SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=1, max_tokens=10, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, frequency_penalty=1.0, seed=2, max_tokens=10, ignore_eos=True, logprobs=0),
    ]
    outs = engine.generate([prompt] * 3, params)
    for out, p in zip(outs, params):
        assert out.logprobs is not None
        _check(out.logprobs, out.output_token_ids, _reference(model, prompt, out.output_token_ids), p.logprobs or 0)


def test_logprobs_validation():
    for bad in (-1, 21, True, 1.5, "3"):
        with pytest.raises(ValueError, match="^logprobs"):
            SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=20).logprobs == 20 and SamplingParams().logprobs is None


def test_openai_shapes(tokenizer):
    render = LogprobsRenderer(tokenizer)
    paris, dot, lyon = (tokenizer.encode(t, add_special_tokens=False)[0] for t in (" Paris", ".", " Lyon"))
    lps = [TokenLogprob(paris, -0.25, ((paris, -0.25), (lyon, -2.0))), TokenLogprob(dot, -float("inf"), ())]
    body, end = render.completion(lps, offset=4)
    assert body == {
        "tokens": [" Paris", "."],
        "token_logprobs": [-0.25, -9999.0],  # JSON has no -Infinity
        "top_logprobs": [{" Paris": -0.25, " Lyon": -2.0}, {".": -9999.0}],  # the sampled token joins
        "text_offset": [4, 10],
    }
    assert end == 11
    chat = render.chat(lps[:1])
    assert chat == {
        "content": [
            {
                "token": " Paris",
                "logprob": -0.25,
                "bytes": list(b" Paris"),
                "top_logprobs": [
                    {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")},
                    {"token": " Lyon", "logprob": -2.0, "bytes": list(b" Lyon")},
                ],
            }
        ]
    }
    eos = tokenizer.eos_token_id
    assert render.chat([TokenLogprob(eos, -1.0)])["content"][0]["token"] == tokenizer.eos_token


@pytest.mark.parametrize("vocab", [49152, 512, 100])
def test_top_k_matches_torch(vocab):
    from orcaserve.scheduler.model.logprobs import top_k

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=gen) * 4
    x[3] = x[3].round()  # many ties
    x[5, ::2] = float("-inf")
    for k in (1, 5, 20):
        values, ids = top_k(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values)  # ties may pick other ids of the same value

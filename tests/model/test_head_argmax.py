"""A greedy step's tokens taken inside the lm_head's GEMM (`Decoder.forward(argmax=True)`,
docs/one-stream.md "The argmax inside the lm_head"): only where every row of the step samples the
logits' plain argmax, and then the very tokens the sampler picks from the logits."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build
from orcaserve.scheduler import Engine, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9] * 40, list(range(3, 150))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Each asks for something only the logits give: the step falls back to the sampler.
OTHERS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 5.0}),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3),
]


def _engine(model, tokenizer):
    return Engine.from_model(
        copy.deepcopy(model), tokenizer, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=64 << 20,
        dtype="bfloat16", quantization="int8", activations="int8",
    )  # fmt: skip


def test_fused_argmax_only_where_the_sampler_takes_the_argmax(tokenizer):
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family("LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    fused, plain = _engine(model, tokenizer), _engine(model, tokenizer)
    assert fused.runner.decoder.head_argmax
    plain.runner.decoder.head_argmax = False  # every step through the logits and the sampler
    head = fused.runner.decoder.lm_head
    calls: list[int] = []
    argmax = head.argmax

    def counted(x):
        calls.append(len(x))
        return argmax(x)

    head.argmax = counted
    for a, b in zip(fused.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 12
    assert calls and max(calls) > 1  # steps of several sampled rows too
    for params in OTHERS:
        calls.clear()
        (one,) = fused.generate(PROMPTS[:1], params)
        (two,) = plain.generate(PROMPTS[:1], params)
        assert one.output_token_ids == two.output_token_ids and one.logprobs == two.logprobs
        assert not calls  # no step of a request that needs the logits took the fused argmax
        # in a batch with two greedy requests that go on after it: the fused argmax once it is done
        mixed = [replace(params, max_tokens=4), GREEDY, GREEDY]
        for a, b in zip(fused.generate(PROMPTS, mixed), plain.generate(PROMPTS, mixed)):
            assert a.output_token_ids == b.output_token_ids and a.logprobs == b.logprobs
        assert calls and max(calls) == 2

"""The decoder layer as one C++ call (scheduler/model/layer_call.py): bit for bit the op-by-op loop
it replaces, and used only where every op of the layer is the C++ op it would call."""

from __future__ import annotations

import copy

import pytest

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build
from orcaserve.scheduler import Engine, SamplingParams

# Three layers: the first runs op by op (no MLP output to add yet), the other two in one call each.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
# A long prompt is chunked (64 tokens a step) beside the others' decodes: steps of 1 to 64 rows.
PROMPTS = [[5, 6, 7, 8], [9] * 40, list(range(3, 150))]


def _engine(model, tokenizer, **kw):
    return Engine.from_model(copy.deepcopy(model), tokenizer, max_num_seqs=4, max_num_batched_tokens=64, **kw)


@pytest.mark.parametrize(("arch", "dtype"), [("LlamaForCausalLM", "float32"), ("Qwen2ForCausalLM", "bfloat16")])
def test_one_call_is_the_op_by_op_loop(arch, dtype, tokenizer):
    """Greedy tokens and log-probabilities bit for bit (Qwen2: q/k/v biases too)."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family(arch, **SHAPE)
    one = _engine(model, tokenizer, dtype=dtype, quantization="int4", activations="int8")
    loop = _engine(model, tokenizer, dtype=dtype, quantization="int4", activations="int8")
    call = one.runner.decoder.layer_call
    assert call is not None
    loop.runner.decoder.layer_call = None
    calls = []
    one.runner.decoder.layer_call = lambda i, *a: calls.append(i) or call(i, *a)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    for a, b in zip(one.generate(PROMPTS, params), loop.generate(PROMPTS, params)):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 12
        assert a.logprobs == b.logprobs and a.logprobs  # each token's and the top 3, bit for bit
    assert calls and set(calls) == {1, 2}


def test_only_where_every_op_is_a_cpp_op(tokenizer):
    """Widened codes (fp32 activations), dense weights, Qwen3's q/k norms: the loop runs."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    llama = tiny_family("LlamaForCausalLM", **SHAPE)
    assert _engine(llama, tokenizer, quantization="int4").runner.decoder.layer_call is None
    assert _engine(llama, tokenizer, dtype="float32").runner.decoder.layer_call is None
    qwen3 = tiny_family("Qwen3ForCausalLM", **SHAPE)
    assert _engine(qwen3, tokenizer, quantization="int4", activations="int8").runner.decoder.layer_call is None

"""A decode step of 1-4 rows in one OpenMP region (kernels/cpu/csrc/fused/layer_region.cpp): bit for
bit the op-by-op loop and the region-less one call a step (ORCASERVE_LAYER_REGION=0), for both GEMM
families it runs: GGUF codes against int8 activations, and dense bf16 (vdpbf16ps where the CPU has
it; elsewhere the region-less call, which the test then holds to the loop too)."""

from __future__ import annotations

import copy

import pytest

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build
from orcaserve.scheduler import Engine, SamplingParams

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
FAMILIES = {"int8": {"quantization": "int4", "activations": "int8"}, "bf16": {}}


def _tokens(model, tokenizer, prompts, family, layer_call=True):
    engine = Engine.from_model(
        copy.deepcopy(model),
        tokenizer,
        dtype="bfloat16",
        **FAMILIES[family],
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory=64 << 20,
    )
    if not layer_call:
        engine.runner.decoder.layer_call = None
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    return [(o.output_token_ids, o.logprobs) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_region_is_the_loop(streams, family, tokenizer, monkeypatch):
    """Qwen2 (q/k/v biases): `streams` prompts decode in steps of `streams` rows (and fewer as they
    end), greedy tokens and log-probabilities bit for bit."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family("Qwen2ForCausalLM", **SHAPE)
    prompts = [[5, 6, 7, 8 + s] * (s + 1) for s in range(streams)]
    monkeypatch.delenv("ORCASERVE_LAYER_REGION", raising=False)
    region = _tokens(model, tokenizer, prompts, family)
    assert region == _tokens(model, tokenizer, prompts, family, layer_call=False)
    monkeypatch.setenv("ORCASERVE_LAYER_REGION", "0")
    assert region == _tokens(model, tokenizer, prompts, family)

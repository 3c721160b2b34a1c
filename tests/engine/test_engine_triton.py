"""The whole engine through the Triton kernels (under the interpreter) matches transformers."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_script

pytestmark = pytest.mark.slow  # the whole engine under the Triton interpreter

SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"  # before any kernel is defined
    import copy, sys, torch
    from orcaserve.bench.models.tiny import hf_greedy
    from transformers import LlamaConfig, LlamaForCausalLM
    from orcaserve.scheduler import Engine, SamplingParams
    from orcaserve.bench.gpu.common import ByteTokenizer  # prompts are token ids

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=512, initializer_range=0.2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 17]
    expected = [hf_greedy(model, p, 5) for p in prompts]
    engine = Engine.from_model(copy.deepcopy(model), ByteTokenizer(), attention_backend="triton",
                               max_num_seqs=4, max_num_batched_tokens=24, block_size=16, dtype="float32")
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    got = [o.output_token_ids for o in outs]
    assert got == expected, (got, expected)
    print("triton engine ok")
    """
)


def test_engine_with_triton_backend_under_interpreter_matches_transformers():
    run_script(SCRIPT, "triton engine ok", timeout=900)

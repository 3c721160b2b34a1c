"""Speculation's verify rows (1 + K query tokens a request) through the Triton kernels, under the
interpreter, are token-exact: prompt lookup on (also with every step padded to its CUDA graph's
sizes) equals it off equals transformers (docs/speculative-decoding.md "The Triton path")."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_script

pytestmark = pytest.mark.slow  # the whole engine under the Triton interpreter

SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"  # before any kernel is defined
    import copy, torch
    from orcaserve.bench.models.tiny import hf_greedy
    from transformers import LlamaConfig, LlamaForCausalLM
    from orcaserve.scheduler import Engine, SamplingParams
    from orcaserve.bench.gpu.common import ByteTokenizer  # prompts are token ids

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.02, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    # Repeating prompts: a small-initialised model copies their cycle, so lookups are accepted.
    prompts = [[3, 4, 5, 6, 7] * 6, [9, 10, 11] * 8, [20, 21, 22, 23] * 5 + [20, 21]]
    n = 12
    expected = [hf_greedy(model, p, n) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    base = dict(attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                dtype="float32")
    outs = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "min_accepted": 0.0}
    # ngram_padded: every step padded to the CUDA graph it would replay (a speculated step, T > B,
    # takes a mixed graph), run eagerly: what a graph computes, on the CPU.
    for name, spec in (("off", None), ("ngram", ngram), ("ngram_padded", ngram)):
        engine = Engine.from_model(copy.deepcopy(model), ByteTokenizer(), speculative=spec, **base)
        assert type(engine.runner.backend).__name__ == "TritonBackend"
        if name == "ngram_padded":
            assert engine.runner.graphs is not None
            engine.runner.pad_steps = True
        outs[name] = [o.output_token_ids for o in engine.generate(prompts, params)]
        if spec is not None:
            st = engine.spec.stats
            print("spec", st.steps_on, st.proposed, st.accepted, flush=True)
            assert st.steps_on > 0 and st.accepted > 0, st
    assert outs["off"] == expected, (outs["off"], expected)
    assert outs["ngram"] == expected, (outs["ngram"], expected)
    assert outs["ngram_padded"] == expected, (outs["ngram_padded"], expected)
    print("triton spec ok")
    """
)


def test_ngram_speculation_with_triton_backend_under_interpreter_matches_transformers():
    run_script(SCRIPT, "triton spec ok", timeout=900)

"""`orcaserve-bench quality`'s bookkeeping: which file a model name reads, and how llama.cpp's
answers are lined up with the fp32 model's positions (its server is replaced by a stand-in that
answers from a table; the real run needs benchmarks/peers/setup_llamacpp.sh)."""

from __future__ import annotations

import pytest
import torch

from orcaserve.bench.cpu import int8_quality
from orcaserve.bench.peers import llamacpp
from orcaserve.scheduler import default_model_path


def test_models_by_name_or_path():
    assert int8_quality.gguf_of("smollm2") == default_model_path()
    assert int8_quality.gguf_of("/x/y.gguf") == "/x/y.gguf"


def test_llamacpp_answers_line_up_with_the_teacher_forced_positions(monkeypatch):
    # Two sequences (prompt, fp32's continuation); the reference's top-1 at each continuation
    # position is the continuation's token (greedy), as in the benchmark.
    seqs = [([1, 5], [7, 8, 9]), ([1], [4, 6])]
    vocab = 10
    ref = [torch.log_softmax(torch.nn.functional.one_hot(torch.tensor(c), vocab).float() * 5, -1) for _, c in seqs]
    asked: list[list[int]] = []

    def greedy_next(path, prefixes):
        asked.extend(prefixes)
        answers = {(1, 5): 7, (1, 5, 7): 8, (1, 5, 7, 8): 0, (1,): 4, (1, 4): 6}  # one position differs
        return [answers[tuple(p)] for p in prefixes]

    monkeypatch.setattr(llamacpp, "greedy_next", greedy_next)
    row = int8_quality.llamacpp_top1("f.gguf", seqs, ref)
    assert asked == [[1, 5], [1, 5, 7], [1, 5, 7, 8], [1], [1, 4]]  # prompt + continuation so far
    assert row == {"top1_agreement": 0.8, "mean_kl_nats": None, "positions": 5}


@pytest.mark.slow  # the shipped model loaded and its codes matched: ~2 min on a busy 2-vCPU machine
def test_int8_activations_with_bf16_rows_run_as_the_engine_does():
    """The "bf16 rows" variant: the model's copy in bf16, its projections QuantLinear(codes, "int8")
    over the file's codes, taking and giving bf16 rows; the fp32 model it copies is left as it was."""
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer
    from orcaserve.scheduler.model.quantized import linears

    path = default_model_path()
    model, _ = load_model_and_tokenizer(path, torch.float32, torch.device("cpu"))
    variant, fmts = int8_quality.with_codes(model, path, "int8", torch.bfloat16)
    assert sum(fmts.values()) == len(list(linears(model)))  # every projection from the file's codes
    assert model.model.norm.weight.dtype == torch.float32 and variant.model.norm.weight.dtype == torch.bfloat16
    seq = [([1, 504, 3575], [282, 4649])]
    [got] = int8_quality.log_probs(variant, seq)
    [ref] = int8_quality.log_probs(model, seq)
    assert got.shape == ref.shape == (2, model.config.vocab_size) and torch.isfinite(got).all()
    with torch.inference_mode():
        x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
        assert variant.model.layers[0].self_attn.q_proj(x).dtype == torch.bfloat16

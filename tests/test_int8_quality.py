"""`orcaserve-bench quality`'s bookkeeping: which file a model name reads, and how llama.cpp's
answers are lined up with the fp32 model's positions (its server is replaced by a stand-in that
answers from a table; the real run needs benchmarks/peers/setup_llamacpp.sh)."""

from __future__ import annotations

import torch

from orcaserve.bench import int8_quality
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

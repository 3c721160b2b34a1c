"""A bf16 engine's LoRA steps read the adapters' weights during each projection's base GEMM
(`LoraStep.project`, `Linear.ahead`; docs/lora.md "Reading the adapters during the base GEMM"):
every such GEMM gives the plain GEMM's bits, over the stacks (several adapters in a step) and over
one adapter's own weights, and the answers are the engine's without it."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import make_adapter, run_mixed

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_family
from orcaserve.kernels import dispatch


def _linears(engine):
    return [getattr(layer, name) for layer in engine.runner.decoder.layers for name in ("qkv", "o", "gate_up", "down")]


@pytest.mark.skipif(dispatch.resolve("linear_ahead", torch.bfloat16) == "torch", reason="no linear_ahead op here")
def test_bf16_steps_read_the_adapters_during_the_gemm_bit_for_bit(engine_for, tmp_path):
    base = tiny_family("LlamaForCausalLM").to(torch.bfloat16)
    make_adapter(base, tmp_path / "a", seed=1, r=8, alpha=16)
    make_adapter(base, tmp_path / "b", seed=2, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    paths = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    work = [(f"r{i}", [(7 * i + j) % (TINY_VOCAB - 3) + 3 for j in range(40 - 4 * i)], 6, ("a", "b", None)[i % 3])
            for i in range(9)]  # fmt: skip
    engine = engine_for(base, dtype="bfloat16", max_num_seqs=6, max_num_batched_tokens=48, lora_adapters=paths)
    read: list[int] = []  # dims of the first tensor each ahead GEMM read: 3 the stacks, 2 an adapter's own
    for lin in _linears(engine):
        assert lin._ahead_op is not None, lin.kernel

        def spy(x, w, b, n, tensors, lin=lin, real=lin._ahead_op):
            got = real(x, w, b, n, tensors)
            assert torch.equal(got, lin._op(x, w, b, n))
            read.append(tensors[0].dim())
            return got

        lin._ahead_op = spy
    results = run_mixed(engine, work[:1], per_step=1)  # steps of one adapter: its own weights
    results |= run_mixed(engine, work[1:], per_step=3)  # then several: the stacks
    assert set(read) == {2, 3}, sorted(set(read))
    plain = engine_for(base, dtype="bfloat16", max_num_seqs=6, max_num_batched_tokens=48, lora_adapters=paths)
    for lin in _linears(plain):
        lin._ahead_op = None
    again = run_mixed(plain, work[:1], per_step=1) | run_mixed(plain, work[1:], per_step=3)
    assert {r: o.output_token_ids for r, o in results.items()} == {r: o.output_token_ids for r, o in again.items()}

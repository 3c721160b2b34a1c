"""int8 activations against GGUF block codes (docs/int8-activations.md): the PyTorch twin's exact
integer sums and fixed fp32 order, the C++ GEMM of every ISA variant this CPU runs equal to it bit
for bit, the configuration's checks, and a model served so through the engine."""

from __future__ import annotations

import pytest
import torch
from cpu_variants import params
from test_quant_gemm import random_codes

from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch import int8_activations as twin
from orcaserve.kernels.quant import FORMATS, GROUP, QuantLinear, QuantLinearGroup, dequantize

INT8 = params("linear_int8")
ROWS = [*range(1, 18), 31, 64, 97, 512]


def test_activation_quantization_by_hand():
    """d = max|x| / 127, codes rounded half to even, clamped, an all-zero block all zero; the sums per 16."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # d = 1: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2
    q, d, sums = twin.quantize_rows(x)
    assert d.tolist() == [[1.0, 0.0]]
    assert q[0, :4].tolist() == [127, -64, 0, 2] and not q[0, 4:].any()
    assert sums.tolist() == [[127 - 64 + 2, 0, 0, 0]]


def test_power_of_two_scale_by_hand():
    """The quality benchmark's variant: sa = 2^ceil(log2(max|x| / 127)), clamped to 2^[E_MIN, E_MAX]
    (an all-zero block 2^E_MIN), codes x / sa rounded half to even; the GEMM otherwise the same."""
    x = torch.zeros(4, 64)
    x[0, :4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # sa = 1: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2
    x[1, :3] = torch.tensor([254.0, 3.0, -5.0])  # d = 2 exactly: sa = 2, 1.5 -> 2, -2.5 -> -2
    x[2, :2] = torch.tensor([254.5, 1.0])  # d just above 2: sa = 4, 63.625 -> 64, 0.25 -> 0
    x[3, :2] = torch.tensor([0.75, 0.375])  # d = 0.0059: sa = 2^-7, 96 and 48
    x[3, 32:34] = torch.tensor([1e-35, 1e35])  # e clamped to E_MAX: 1e35 / 2^100 = 78886 -> 127
    q, d, sums = twin.quantize_rows(x, pow2=True)
    tiny = 2.0**twin.E_MIN
    assert d.tolist() == [[1.0, tiny], [2.0, tiny], [4.0, tiny], [2.0**-7, 2.0**twin.E_MAX]]
    assert q[0, :4].tolist() == [127, -64, 0, 2] and not q[0, 4:].any()
    assert q[1, :3].tolist() == [127, 2, -2] and q[2, :2].tolist() == [64, 0]
    assert q[3, :2].tolist() == [96, 48] and q[3, 32:34].tolist() == [0, 127]
    assert sums.tolist()[0] == [127 - 64 + 2, 0, 0, 0]
    codes = random_codes("q4_0", 8, 64, 5)
    xs = torch.randn(3, 64)
    got = twin.linear_int8(xs, codes.q, codes.scale, codes.offset, None, pow2=True)
    qa, sa, _ = twin.quantize_rows(xs, pow2=True)
    want = (qa.float() * sa.repeat_interleave(32, 1)) @ dequantize(codes).t()  # the same roundings, other order
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", INT8)
def test_kernel_quantizes_activations_as_the_twin(variant):
    op = getattr(torch.ops.orcaserve.quantize_rows_int8, variant)
    x = torch.randn(37, 320) * torch.logspace(-3, 3, 320)
    x[3] = 0.0
    x[5, :32] = torch.tensor([2.5, -2.5] * 16)  # halves after the scale: ties
    strided = torch.cat([x, x], dim=1)[:, 320:]  # rows 640 apart: read in place
    for xx in (x, x.bfloat16(), strided, torch.cat([x, x], dim=1).bfloat16()[:, 320:]):
        for a, b in zip(op(xx), twin.quantize_rows(xx)):
            assert torch.equal(a, b)
    long = torch.randn(3, 33 * 32) * torch.logspace(-2, 2, 33 * 32)  # bf16 rows go by chunks of 16 blocks
    for a, b in zip(op(long.bfloat16()), twin.quantize_rows(long.bfloat16())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_twin_is_close_to_the_dequantized_gemm(fmt):
    """The twin's error is the activations' rounding: within a few percent of the fp32 GEMM."""
    n, k = 40, 256
    codes = random_codes(fmt, n, k, 3)
    x = torch.randn(9, k)
    got = twin.linear_int8(x, codes.q, codes.scale, codes.offset, None)
    want = x @ dequantize(codes).t()
    assert ((got - want).norm() / want.norm()).item() < 0.02


@pytest.mark.parametrize("variant", INT8)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_is_the_twin_bit_for_bit(variant, fmt):
    """Every row count (row tiles of each height, 1..512), an odd N (last panel partial), K = 32 * odd,
    with and without bias, fp32 and bf16 x."""
    for n, k in ((77, 160), (33, 96)):
        codes = random_codes(fmt, n, k, 7 + n)
        for bias in (torch.randn(n), None):
            lin = QuantLinear(codes, bias, kernel=f"orcaserve.linear_int8.{variant}", activations="int8")
            assert lin.kernel == f"orcaserve.linear_int8.{variant}"
            for rows in ROWS if bias is not None and n == 77 else (1, 5, 33):
                x = torch.randn(rows, k) * 3
                for xx in (x, x.bfloat16()):
                    want = twin.linear_int8(xx, codes.q, codes.scale, codes.offset, bias)
                    got = lin(xx)
                    assert got.dtype == xx.dtype and torch.equal(got, want), (rows, xx.dtype)
            wide = torch.randn(33, 2 * k) * 3  # rows strided, as a view of a wider tensor
            for xx in (wide[:, k:], wide.bfloat16()[:, :k]):
                assert torch.equal(lin(xx), twin.linear_int8(xx, codes.q, codes.scale, codes.offset, bias))


@pytest.mark.parametrize("variant", INT8)
def test_extreme_codes_and_activations(variant):
    """Codes at the ends of each range against activations at +-127 (vpmaddubsw's int16 pairs stay
    exact; q8_0's -128 goes through the sign trick without VNNI)."""
    n, k = 48, 64
    for fmt in FORMATS:
        codes = random_codes(fmt, n, k, 1)
        lo = {"q8_0": -128, "q4_0": -8, "q4_1": 0, "q4_k": 0, "q6_k": -32}[fmt]
        hi = {"q8_0": 127, "q4_0": 7, "q4_1": 15, "q4_k": 15, "q6_k": 31}[fmt]
        q = codes.q.clone()
        q[: n // 2] = lo
        q[n // 2 :] = hi
        codes = type(codes)(fmt, q, codes.scale, codes.offset)
        x = torch.ones(3, k)
        x[1] = -1
        x[2, ::2] = -1
        lin = QuantLinear(codes, None, kernel=f"orcaserve.linear_int8.{variant}", activations="int8")
        assert torch.equal(lin(x), twin.linear_int8(x, codes.q, codes.scale, codes.offset, None)), fmt


def test_dispatch_and_fallback():
    """The table's linear_int8 row resolves per format; the twin where the kernel is forced to it."""
    codes = random_codes("q4_0", 16, 64)
    lin = QuantLinear(codes, None, activations="int8")
    want = dispatch.resolve("linear_int8", "q4_0")
    assert lin.kernel == want
    if dispatch.capability() in ("avx512_bf16", "amx") and dispatch.vnni() and INT8:
        assert want == f"orcaserve.linear_int8.{dispatch.capability()}"
    tw = QuantLinear(codes, None, kernel="torch", activations="int8")
    x = torch.randn(4, 64)
    assert tw.kernel == "torch" and torch.equal(tw(x), lin(x))
    group = QuantLinearGroup([(codes, None), (random_codes("q6_k", 8, 64), None)], activations="int8")
    assert all(p.activations == "int8" for p in group.parts) and group(x).shape == (4, 24)
    with pytest.raises(ValueError, match="activations"):
        QuantLinear(codes, None, activations="int4")
    assert GROUP == 32


def test_config_checks():
    from orcaserve.scheduler.config import EngineConfig

    assert EngineConfig(quantization="int4", activations="int8", device="cpu").activations == "int8"
    with pytest.raises(ValueError, match="quantized weights only"):
        EngineConfig(quantization="none", activations="int8", device="cpu")
    with pytest.raises(ValueError, match="activations must be"):
        EngineConfig(quantization="gguf", activations="int4", device="cpu")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_answers_as_the_twin(mode, tokenizer, monkeypatch):
    """A tiny Llama quantized at load (int8: q8_0; int4: q4_1 layers, q8_0 lm_head) and served with
    activations="int8": greedy tokens and log-probabilities equal to the engine on the PyTorch twin,
    bit for bit; against the fp32 model the agreement is reported, not asserted equal."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from orcaserve.bench.models.tiny import TINY_CONFIG
    from orcaserve.kernels import quant
    from orcaserve.scheduler import Engine, SamplingParams

    cfg = LlamaConfig(**{**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256})
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).eval()
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9] * 40, list(range(3, 100))]

    def answers(**kw):
        engine = Engine.from_model(
            copy.deepcopy(dense), tokenizer, dtype="float32", max_num_batched_tokens=64, kv_cache_memory=64 << 20, **kw
        )
        return engine, engine.generate(prompts, params)

    engine, kernel = answers(quantization=mode, activations="int8")
    layer = engine.runner.decoder.layers[0]
    assert layer.qkv.activations == "int8"
    with monkeypatch.context() as m:
        m.setattr(quant, "takes", lambda k, codes: k == "torch")
        engine_t, twin_out = answers(quantization=mode, activations="int8")
    assert engine_t.runner.decoder.layers[0].qkv.kernel == "torch"
    _, fp32 = answers()
    same = total = 0
    for a, b, c in zip(kernel, twin_out, fp32):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 12
        assert [t.logprob for t in a.logprobs or []] == [t.logprob for t in b.logprobs or []]
        same += sum(x == y for x, y in zip(a.output_token_ids, c.output_token_ids))
        total += len(c.output_token_ids)
    print(f"{mode} weights, int8 activations: {same}/{total} greedy tokens as the fp32 model's")

"""GGUF K-quants served quantized (docs/kernels.md "Quantized GEMM on the CPU", docs/serving.md
"Quantized weights"): Q4_K and Q6_K super-blocks parsed into BlockCodes whose dequantization is
gguf-py's bit for bit, matched to modules by content (rows permuted too) from a GGUF file, and the
C++ GEMM over them bit for bit the fp32 GEMM on the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cpu_variants import params

from orcaserve.kernels.linear import Linear
from orcaserve.kernels.quant import QuantLinear, dequantize
from orcaserve.scheduler.model.gguf_blocks import match_gguf_blocks, parse_blocks

gguf = pytest.importorskip("gguf")
QGEMM = params("linear_quant")
T = gguf.GGMLQuantizationType
KINDS = {"q4_k": (T.Q4_K, 144, (1, 3)), "q6_k": (T.Q6_K, 210, (209,))}  # type, bytes, fp16 high bytes


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes are valid K-quant super-blocks once the fp16 d (and dmin) are finite: every
    6-bit scale and min, every code pattern. uint8 [N, K / 256 * block bytes], as a file holds them."""
    _, size, highs = KINDS[fmt]
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for h in highs:
        raw[:, :, h] &= 0x3B  # a small fp16 exponent: no inf or NaN, sums stay finite
    return raw.reshape(n, -1)


@pytest.mark.parametrize("fmt", KINDS)
def test_parsed_k_quants_dequantize_as_gguf_py(fmt):
    raw = random_blocks(fmt, 24, 768)
    codes = parse_blocks(raw, fmt, 768)
    assert codes.fmt == fmt and codes.q.shape == (24, 768)
    lo, hi = (0, 15) if fmt == "q4_k" else (-32, 31)
    assert int(codes.q.min()) == lo and int(codes.q.max()) == hi
    want = gguf.quants.dequantize(raw, KINDS[fmt][0])
    assert np.array_equal(dequantize(codes).numpy().view(np.uint32), want.view(np.uint32))


def test_matched_from_a_gguf_file_rows_permuted(tmp_path):
    """A file with a Q4_K and a Q6_K tensor: modules holding their gguf-py dequantization, one with
    its rows permuted (as transformers un-permutes q/k), get codes that reproduce them bit for bit;
    a weight one bit off gets none."""
    path = str(tmp_path / "k.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    tensors = {"a": ("q4_k", random_blocks("q4_k", 16, 512, 1)), "b": ("q6_k", random_blocks("q6_k", 8, 256, 2))}
    for name, (fmt, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=KINDS[fmt][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dense = {name: torch.from_numpy(gguf.quants.dequantize(raw, KINDS[fmt][0])) for name, (fmt, raw) in tensors.items()}
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    off = dense["b"].clone()
    off[1, 2] = torch.nextafter(off[1, 2], torch.tensor(1e9))
    mods = {"a": dense["a"], "a_perm": dense["a"][perm], "b": dense["b"], "b_off": off}
    named = [(name, torch.nn.Linear(1, 1, bias=False)) for name in mods]
    for name, module in named:
        module.weight = torch.nn.Parameter(mods[name], requires_grad=False)
    found = match_gguf_blocks(path, named)
    assert found["b_off"] is None
    for name in ("a", "a_perm", "b"):
        codes = found[name]
        assert codes is not None and codes.fmt == ("q4_k" if name.startswith("a") else "q6_k")
        assert torch.equal(dequantize(codes).view(torch.int32), mods[name].view(torch.int32)), name


@pytest.mark.parametrize("variant", QGEMM)
@pytest.mark.parametrize("fmt", KINDS)
def test_gemm_on_file_blocks_is_the_fp32_gemm_bit_for_bit(variant, fmt):
    """The file's own blocks (not only test_quant_gemm.py's synthetic codes), fp32 and bf16 x."""
    n, k = 53, 512
    codes = parse_blocks(random_blocks(fmt, n, k, 4), fmt, k)
    bias = torch.randn(n)
    lin = QuantLinear(codes, bias, kernel=f"orcaserve.linear_quant.{variant}")
    ref = Linear(dequantize(codes), bias, pack=True, kernel=f"orcaserve.linear_packed.{variant}")
    for rows in (1, 2, 3, 4, 7, 40, 97):
        x = torch.randn(rows, k)
        assert torch.equal(lin(x), ref(x)), rows
        assert torch.equal(lin(x.bfloat16()), ref(x.bfloat16().float()).bfloat16()), rows


def test_mixed_formats_in_a_fused_group_stay_quantized():
    """q/k in Q4_K and v in Q6_K (Q4_K_M's layers): the fused q/k/v is one QuantLinear per run of a
    format, its output the fused dense GEMM's bit for bit (each column its own sum), and a bias
    (Qwen2's) split with it."""
    from orcaserve.kernels.quant import QuantLinearGroup
    from orcaserve.scheduler.model.quantized import CODES, fused_linear

    k = 256
    fmts = ("q4_k", "q4_k", "q6_k")
    mods, weights = [], []
    for i, fmt in enumerate(fmts):
        codes = parse_blocks(random_blocks(fmt, 24 + 8 * i, k, 10 + i), fmt, k)
        m = torch.nn.Linear(k, codes.q.shape[0])
        setattr(m, CODES, codes)
        mods.append(m)
        weights.append(dequantize(codes))
    bias = torch.cat([m.bias.detach().clone() for m in mods])
    group = fused_linear(*mods, pack=True, dtype=torch.float32)
    assert isinstance(group, QuantLinearGroup) and [p.fmt for p in group.parts] == ["q4_k", "q6_k"]
    ref = Linear(torch.cat(weights), bias, pack=True)
    for rows in (1, 3, 40):
        x = torch.randn(rows, k)
        got = group(x)
        if group.kernel.startswith("orcaserve.") and ref.kernel.startswith("orcaserve."):
            assert torch.equal(got, ref(x)), rows
        torch.testing.assert_close(got, x @ torch.cat(weights).t() + bias, atol=1e-3, rtol=1e-4)


def test_q4_k_m_model_answers_as_its_dequantized_twin(tokenizer):
    """A tiny Llama laid out as a Q4_K_M file is (q/k/o/gate/up Q4_K; v, down and lm_head Q6_K, so
    the fused q/k/v mixes formats), served from its codes through the engine: greedy tokens and
    log-probabilities equal, bit for bit, to the engine on the dequantized fp32 weights (the C++
    GEMM's promise; the PyTorch twin within its tolerance)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from orcaserve.bench.models.tiny import TINY_CONFIG
    from orcaserve.scheduler import Engine, SamplingParams
    from orcaserve.scheduler.model.quantized import QUANTIZED, attach, linears

    # TINY_CONFIG's model, wider: every K a multiple of 256 (K-quant super-blocks), lm_head untied.
    cfg = LlamaConfig(**{**TINY_CONFIG, "hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": False})
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).eval()
    quant = copy.deepcopy(dense)
    for i, ((name, d), (_, q)) in enumerate(zip(linears(dense), linears(quant))):
        fmt = "q6_k" if name.endswith(("v_proj", "down_proj", "lm_head")) else "q4_k"
        n, k = d.weight.shape
        raw = random_blocks(fmt, n, k, 100 + i).reshape(n, k // 256, -1)
        for h in KINDS[fmt][2]:
            raw[:, :, h] &= 0x27  # d below 2^-7: activations stay far from fp32's range over 2 layers
        codes = parse_blocks(raw.reshape(n, -1), fmt, k)
        d.weight = torch.nn.Parameter(dequantize(codes), requires_grad=False)
        attach(q, codes)
    setattr(quant, QUANTIZED, "gguf")  # as the streamed load leaves it: quantize_model keeps the codes
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9] * 40, list(range(3, 120))]
    answers = []
    for model, mode in ((dense, None), (quant, "gguf")):
        engine = Engine.from_model(
            model, tokenizer, dtype="float32", quantization=mode, max_num_batched_tokens=64, kv_cache_memory=64 << 20
        )
        answers.append(engine.generate(prompts, params))
    decoder = engine.runner.decoder
    assert decoder is not None and type(decoder.layers[0].qkv).__name__ == "QuantLinearGroup"
    assert [p.fmt for p in decoder.layers[0].qkv.parts] == ["q4_k", "q6_k"]
    exact = all(p.kernel.startswith("orcaserve.") for p in decoder.layers[0].qkv.parts)  # both formats in C++
    for a, b in zip(*answers):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 10
        la, lb = [t.logprob for t in a.logprobs or []], [t.logprob for t in b.logprobs or []]
        assert all(np.isfinite(la))  # random codes, tamed scales: nothing overflowed
        assert la == lb if exact else np.allclose(la, lb, rtol=0, atol=1e-4)

"""Quantized weights served quantized (docs/serving.md "Quantized weights"): the engine's tokens
against transformers over the same dequantized weights in fp32, GGUF blocks matched to the
modules bit for bit, and the option's validation and refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_family, tiny_model
from orcaserve.kernels.quant import dequantize, quantize
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model.families import UnsupportedArchitecture
from orcaserve.scheduler.model.gguf_blocks import match_gguf_blocks, matched_permutation, parse_blocks
from orcaserve.scheduler.model.quantized import CODES, MODE_FORMATS, linears

WORK = [([5, 6, 7, 8], 12), ([9] * 40, 12), (list(range(3, 120)), 16), ([TINY_VOCAB - 1, 4], 12)]


def _fake_quantized(model, mode: str):
    """A copy of `model` whose projections hold dequantize(quantize(w)) in fp32: the reference."""
    ref = copy.deepcopy(model)
    layer_fmt, head_fmt = MODE_FORMATS[mode]
    with torch.no_grad():
        for name, module in linears(ref):
            module.weight.copy_(dequantize(quantize(module.weight, head_fmt if name == "lm_head" else layer_fmt)))
    return ref


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "Qwen3ForCausalLM"])
def test_weight_only_modes_match_transformers_on_dequantized_weights(arch, mode, engine_for):
    """Qwen2 brings q/k/v biases, Qwen3 its per-head q/k norms; the lm_head is quantized too."""
    model = tiny_model(arch) if arch in ("llama", "qwen2") else tiny_family(arch)
    ref = _fake_quantized(model, mode)
    engine = engine_for(model, quantization=mode, max_num_seqs=4, max_num_batched_tokens=64)
    decoder = engine.runner.decoder
    assert decoder is not None and type(decoder.layers[0].qkv).__name__ == "QuantLinear"
    assert type(decoder.lm_head).__name__ == "QuantLinear"
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in WORK]
    outs = engine.generate([p for p, _ in WORK], params)
    for (prompt, n), out in zip(WORK, outs):
        assert out.output_token_ids == hf_greedy(ref, prompt, n)


def test_quantization_frees_the_dense_weights(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model, quantization="int8")
    assert all(m.weight.numel() == 0 and not hasattr(m, CODES) for _, m in linears(engine.runner.model))
    assert engine.runner.model.model.embed_tokens.weight.shape == (TINY_VOCAB, 64)  # the lookup stays dense


def test_parsed_blocks_dequantize_as_gguf_py():
    """The block layouts parsed here (gguf_blocks.py) against gguf-py's own reader of them."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * 0.05).astype(np.float32)
    w[3, :32] = 0.0  # a block of zeros: scale 0
    for kind, fmt in ((GGMLQuantizationType.Q8_0, "q8_0"), (GGMLQuantizationType.Q4_0, "q4_0")):
        raw = quants.quantize(w, kind)
        expected = quants.dequantize(raw, kind)
        got = dequantize(parse_blocks(raw, fmt, 96)).numpy()
        assert np.array_equal(got.view(np.int32), expected.view(np.int32)), fmt
    # Q4_1: gguf-py has no quantizer for it; random bytes are valid blocks (finite fp16 d and m).
    raw = rng.integers(0, 256, (24, 3 * 20), dtype=np.uint8)
    blocks = raw.reshape(24, 3, 20)
    blocks[:, :, 1] &= 0x3B  # keep the fp16 exponents small: no inf or NaN
    blocks[:, :, 3] &= 0x3B
    expected = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    got = dequantize(parse_blocks(raw, "q4_1", 96)).numpy()
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))


def test_option_is_validated_and_refused_where_it_cannot_run(engine_for):
    from orcaserve.handler.config import HandlerConfig

    for value in (None, "gguf", "int8", "int4"):
        EngineConfig(quantization=value)
    for value in ("q4_0", "INT8", 4, True):
        with pytest.raises(ValueError, match="quantization"):
            EngineConfig(quantization=value)
    with pytest.raises(ValueError, match="quantization"):
        HandlerConfig.from_dict({"quantization": "fp8"})
    assert HandlerConfig.from_dict({"quantization": "int4"}).engine["quantization"] == "int4"
    with pytest.raises(UnsupportedArchitecture, match="lean decoder"):
        engine_for(tiny_family("Phi3ForCausalLM"), quantization="int8")
    with pytest.raises(ValueError, match=r"\.gguf"):
        engine_for(tiny_model("llama"), quantization="gguf")
    with pytest.raises(ValueError, match="low-bit GEMMs only"):  # not a dequantized copy on a GPU
        engine_for(tiny_model("llama"), quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="low-bit GEMMs only"):  # refused before loading: no such path needed
        Engine.from_pretrained("/no/such/model.gguf", quantization="gguf", device="cuda")


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_path):
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    return load_model_and_tokenizer(smollm2_path, torch.float32, torch.device("cpu"))[0]


@pytest.mark.slow
def test_gguf_blocks_match_by_content(smollm2_fp32, smollm2_path):
    """q and k come out of transformers row-permuted (llama.cpp's rotary layout undone); the match
    recovers it. A weight changed in one bit verifies against nothing and stays dense."""
    model = copy.deepcopy(smollm2_fp32)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.v_proj.weight[1, 2] = torch.nextafter(attn.v_proj.weight[1, 2], torch.tensor(1.0))
    named = [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("lm_head", model.lm_head)]
    found = match_gguf_blocks(smollm2_path, named)
    assert found["v"] is None
    for name, module in named[:2] + named[3:]:
        codes = found[name]
        assert codes is not None and torch.equal(dequantize(codes), module.weight)
    assert found["q"].fmt == "q4_1" and found["lm_head"].fmt == "q8_0"  # type: ignore[union-attr]
    perm = matched_permutation(smollm2_path, "blk.0.attn_q.weight", attn.q_proj)
    assert perm is not None and not perm.equal(torch.arange(len(perm)))


@pytest.mark.slow
def test_gguf_mode_equals_the_dequantized_engine(smollm2_fp32, tokenizer):
    """The default model's own Q4_1 blocks (and its tied Q8_0 embedding as the lm_head), fp32
    activations: greedy tokens and their log-probabilities those of the engine over the fp32
    dequantized weights. Bit for bit where the C++ GEMM runs (its promise, kernels/quant.py); the
    PyTorch twin sums in another order: 1e-4 there."""

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 12?")
    ] + ["def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2, ignore_eos=True)
    answers = {}
    for mode in (None, "gguf"):
        engine = Engine.from_model(
            copy.deepcopy(smollm2_fp32), tokenizer, dtype="float32", quantization=mode, max_num_batched_tokens=64
        )
        answers[mode] = engine.generate(prompts, params)
        if mode == "gguf":
            decoder = engine.runner.decoder
            assert decoder is not None and all(
                type(g).__name__ == "QuantLinear" for layer in decoder.layers for g in (layer.qkv, layer.down)
            )
            exact = decoder.layers[0].qkv.kernel.startswith("orcaserve.")
    for dense, quant in zip(answers[None], answers["gguf"]):
        assert quant.output_token_ids == dense.output_token_ids
        a = [t.logprob for t in dense.logprobs or []]
        b = [t.logprob for t in quant.logprobs or []]
        assert a == b if exact else np.allclose(a, b, rtol=0, atol=1e-4)
    assert "Paris" in answers["gguf"][0].text

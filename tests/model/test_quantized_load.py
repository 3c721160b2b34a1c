"""Quantized weights loaded one tensor at a time (docs/serving.md "Quantized weights", "Memory at
load"): the streamed load serves the same codes and dense tensors, bit for bit, as loading the
whole model in fp32 then quantize_model and the cast to dtype, and so the same tokens and
log-probabilities."""

from __future__ import annotations

import copy

import pytest
import torch

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.model.families import UnsupportedArchitecture
from orcaserve.scheduler.model.loader import load_model_and_tokenizer
from orcaserve.scheduler.model.quantized import CODES, QUANTIZED, linears, quantize_model

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7, 8], [9] * 40, list(range(3, 120))]
KV = 64 << 20  # the KV cache of conftest's engine_for: the CPU default (1 GiB) is zero-filled per engine


def _both(path: str, mode: str, dtype: torch.dtype):
    """(the fp32 load quantized after, as before; the streamed load) of `path` in `dtype`."""
    old, _ = load_model_and_tokenizer(path, torch.float32, CPU)
    quantize_model(old, mode, dtype)
    old.to(dtype=dtype)
    new, _ = load_model_and_tokenizer(path, dtype, CPU, quantization=mode)
    new.to(dtype=dtype)  # Engine.from_model's cast: the buffers (rotary) and the freed weights' stubs
    return old, new


def _assert_same_served(old, new) -> None:
    """Every projection's codes (or dense weight) and every other tensor equal, bit for bit."""
    for (name, a), (_, b) in zip(linears(old), linears(new)):
        ca, cb = getattr(a, CODES, None), getattr(b, CODES, None)
        assert (ca is None) == (cb is None), name
        if ca is not None and cb is not None:
            assert ca.fmt == cb.fmt and torch.equal(ca.q, cb.q) and torch.equal(ca.scale, cb.scale), name
            assert (ca.offset is None) == (cb.offset is None), name
            assert ca.offset is None or torch.equal(ca.offset, cb.offset), name
    sa, sb = old.state_dict(), new.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    assert old.generation_config.to_dict() == new.generation_config.to_dict()


def _answers(model, tokenizer, mode: str, dtype: str, prompts):
    engine = Engine.from_model(
        model, tokenizer, dtype=dtype, quantization=mode, max_num_batched_tokens=64, kv_cache_memory=KV
    )
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    return [(o.output_token_ids, [t.logprob for t in o.logprobs or []]) for o in engine.generate(prompts, params)]


def _saved(tmp_path, tokenizer, arch: str = "LlamaForCausalLM", **overrides) -> str:
    model = tiny_family(arch, **overrides)
    model.save_pretrained(tmp_path)  # safetensors
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(("mode", "tied"), [("int8", False), ("int4", False), ("int4", True)])
def test_streamed_int_modes_serve_what_the_fp32_load_did(tmp_path, tokenizer, mode, tied):
    """Tied: the lm_head's codes come from the embedding (q8_0), which stays dense."""
    path = _saved(tmp_path, tokenizer, tie_word_embeddings=tied)
    old, new = _both(path, mode, torch.float32)
    _assert_same_served(old, new)
    assert getattr(new.lm_head, CODES).fmt == "q8_0" and new.lm_head.weight.numel() == 0
    assert new.model.embed_tokens.weight.shape[0] == new.config.vocab_size
    assert _answers(old, tokenizer, mode, "float32", PROMPTS) == _answers(new, tokenizer, mode, "float32", PROMPTS)


def test_streamed_dense_weights_come_in_the_engine_dtype(tmp_path, tokenizer):
    path = _saved(tmp_path, tokenizer, tie_word_embeddings=True)
    old, new = _both(path, "int8", torch.bfloat16)
    _assert_same_served(old, new)
    assert new.model.embed_tokens.weight.dtype == torch.bfloat16


def test_refused_family_is_refused_before_the_weights(tmp_path, tokenizer, monkeypatch):
    import orcaserve.scheduler.model.stream_load as stream_load

    path = _saved(tmp_path, tokenizer, "Phi3ForCausalLM")
    monkeypatch.setattr(stream_load, "_safetensors", lambda folder: pytest.fail("weights read"))
    with pytest.raises(UnsupportedArchitecture, match="lean decoder"):
        load_model_and_tokenizer(path, torch.float32, CPU, quantization="int8")


def test_quantize_model_leaves_a_streamed_model_alone(tmp_path, tokenizer):
    new, _ = load_model_and_tokenizer(_saved(tmp_path, tokenizer), torch.float32, CPU, quantization="int4")
    codes = getattr(new.lm_head, CODES)
    quantize_model(new, "int4", torch.float32)
    assert getattr(new.lm_head, CODES) is codes
    with pytest.raises(ValueError, match="loaded with quantization='int4'"):
        quantize_model(new, "int8", torch.float32)


@pytest.mark.slow
def test_streamed_gguf_serves_what_the_fp32_load_did(smollm2_path, tokenizer):
    """The default model: Q4_1 layers with q/k rows permuted, its tied lm_head from the Q8_0
    embedding; the same tokens and log-probabilities through the engine."""
    old, new = _both(smollm2_path, "gguf", torch.float32)
    _assert_same_served(old, new)
    assert getattr(new.lm_head, CODES).fmt == "q8_0"
    prompts = ["What is the capital of France?", "def fibonacci(n):"]
    a = _answers(copy.deepcopy(old), tokenizer, "gguf", "float32", prompts)
    assert a == _answers(new, tokenizer, "gguf", "float32", prompts)


def test_from_pretrained_streams_and_answers_as_before(tmp_path, tokenizer):
    """Engine.from_pretrained's load: the streamed model, the same answers as the fp32 load."""
    path = _saved(tmp_path, tokenizer, tie_word_embeddings=True)
    old, _ = load_model_and_tokenizer(path, torch.float32, CPU)
    engine = Engine.from_pretrained(
        path, dtype="float32", quantization="int4", max_num_batched_tokens=64, kv_cache_memory=KV
    )
    assert getattr(engine.runner.model, QUANTIZED) == "int4"
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    got = [(o.output_token_ids, [t.logprob for t in o.logprobs or []]) for o in engine.generate(PROMPTS, params)]
    assert got == _answers(old, tokenizer, "int4", "float32", PROMPTS)

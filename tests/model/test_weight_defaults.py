"""`quantization` and `activations` left null (docs/quantized-weights.md "Defaults"): a GGUF file on a
CPU with integer dot products is served from its own blocks with int8 activations; anything else
dense; `quantization: none` names the dense exact path; what the user names is kept."""

from __future__ import annotations

import logging
import warnings

import pytest

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.model import defaults
from orcaserve.scheduler.model.defaults import choose_weights
from orcaserve.scheduler.model.quantized import QUANTIZED

needs_int8 = pytest.mark.skipif(not defaults.integer_dot_products(), reason="no integer dot products here")


@needs_int8
def test_a_gguf_is_served_as_its_file_intends(smollm2_path):
    chosen = choose_weights(EngineConfig(device="cpu"), smollm2_path)
    assert (chosen.quantization, chosen.activations) == ("gguf", "int8")
    assert choose_weights(EngineConfig(device="cpu", activations="int8"), smollm2_path).activations == "int8"


def test_named_settings_are_kept(smollm2_path):
    for q in ("none", "gguf", "int8"):
        assert choose_weights(EngineConfig(device="cpu", quantization=q), smollm2_path).quantization == q
    assert choose_weights(EngineConfig(device="cpu", quantization="gguf"), smollm2_path).activations is None
    assert EngineConfig(quantization="none").quantized() is None and EngineConfig().quantized() is None
    with pytest.raises(ValueError, match="quantized weights only"):
        EngineConfig(quantization="none", activations="int8")


def test_lora_adapters_keep_the_gguf_dense(smollm2_path):
    """Adapters are proven over dense weights only (docs/lora.md): the default gives them those,
    and `quantization: none` with adapters is accepted (a named quantization is refused)."""
    lora = {"a": "/adapter"}
    assert choose_weights(EngineConfig(device="cpu", lora_adapters=lora), smollm2_path).quantization == "none"
    assert EngineConfig(device="cpu", quantization="none", lora_adapters=lora).quantized() is None
    with pytest.raises(ValueError, match="LoRA"):
        EngineConfig(device="cpu", quantization="gguf", lora_adapters=lora)


def test_dense_where_quantized_would_not_pay(smollm2_path, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=defaults.__name__)
    assert choose_weights(EngineConfig(device="cpu"), str(tmp_path)).quantization == "none"  # not a GGUF
    tp = EngineConfig(device="cpu", tensor_parallel_size=2)
    assert choose_weights(tp, smollm2_path).quantization == "none"
    monkeypatch.setattr(defaults, "integer_dot_products", lambda: False)  # a CPU without AVX2
    assert choose_weights(EngineConfig(device="cpu"), smollm2_path).quantization == "none"
    assert "no integer dot products" in caplog.text
    with pytest.raises(ValueError, match="quantized weights only, and this CPU has no integer dot products"):
        choose_weights(EngineConfig(device="cpu", activations="int8"), smollm2_path)


def test_from_model_never_quantizes_unasked(tokenizer):
    engine = Engine.from_model(tiny_family("LlamaForCausalLM"), tokenizer, dtype="float32", kv_cache_memory=1 << 20)
    assert not hasattr(engine.runner.model, QUANTIZED)
    with pytest.raises(ValueError, match="set quantization"):
        Engine.from_model(tiny_family("LlamaForCausalLM"), tokenizer, activations="int8", kv_cache_memory=1 << 20)


@pytest.mark.slow  # loads the real model twice over; the full suite runs it
@needs_int8
def test_first_load_of_the_default_model(smollm2_path, caplog):
    """A newcomer's first load: quantized with int8 activations, said in the engine's own log line,
    and no warning from transformers about the dtype it was loaded in."""
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine.from_pretrained(smollm2_path, kv_cache_memory=16 << 20, max_num_seqs=4)
    assert (engine.config.quantization, engine.config.activations) == ("gguf", "int8")
    assert "quantization chosen: gguf with int8 activations" in caplog.text
    assert "Pass `dtype=torch.float32`" not in caplog.text and "Dequantizing the whole model" not in caplog.text
    out = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.output_token_ids) == 4


@pytest.mark.slow  # a real dense load of the default model; the full suite runs it
def test_dense_gguf_load_says_nothing_of_packed_weights(smollm2_path, caplog):
    caplog.set_level(logging.INFO)
    engine = Engine.from_pretrained(
        smollm2_path, quantization="none", dtype="bfloat16", kv_cache_memory=16 << 20, max_num_seqs=4
    )
    assert engine.config.quantized() is None
    assert "Pass `dtype=torch.float32`" not in caplog.text and "Dequantizing the whole model" not in caplog.text

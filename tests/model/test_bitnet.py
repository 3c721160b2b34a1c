"""BitNet b1.58 served by the lean decoder from its packed ternary weights: the ternary layer bit
for bit transformers' `BitLinear`, the model token-exact against transformers' fp32 forward, and
what cannot be served exactly refused at load (docs/bitnet.md)."""

from __future__ import annotations

import random

import pytest
import torch

from orcaserve.bench.models.tiny import TINY_VOCAB, bitnet_checkpoint, hf_greedy
from orcaserve.kernels.ternary import TernaryLinear, unpack_ternary
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.families import UnsupportedArchitecture

# Lengths across block (16) and chunk (64-token budget) boundaries, served together.
_LENGTHS = [(1, 8), (17, 12), (200, 16), (70, 20), (33, 5)]


@pytest.fixture(autouse=True)
def eager_bitlinear(monkeypatch):
    """transformers' BitLinear wraps its quantization in torch.compile: run the functions it
    compiles eagerly (the same ops, without minutes of compiling on a 2-core machine)."""
    from transformers.integrations import bitnet

    for owner, name in (
        (bitnet.BitLinear, "activation_quant"),
        (bitnet.BitLinear, "post_quant_process"),
        (bitnet, "unpack_weights"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name)._torchdynamo_orig_callable)


def _load(path: str):
    from transformers import BitNetForCausalLM

    model = BitNetForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def bitnet_dir(tmp_path_factory):
    return bitnet_checkpoint(str(tmp_path_factory.mktemp("bitnet")))


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_ternary_linear_is_bitlinear_bit_for_bit(bitnet_dir, rows):
    model = _load(bitnet_dir)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    torch.manual_seed(rows)
    for parts, width in (((attn.q_proj, attn.k_proj, attn.v_proj), 64), ((mlp.gate_proj, mlp.up_proj), 64)):
        x = torch.randn(rows, width) * 3
        x[0] = 0.0  # an all-zero row (a step's pad row): the scale's clamp, no NaN
        fused = TernaryLinear.fuse([(p.weight, p.weight_scale) for p in parts])
        with torch.inference_mode():
            assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_unpack_refuses_a_code_of_three():
    with pytest.raises(ValueError, match="code 3"):
        unpack_ternary(torch.full((2, 8), 0xFF, dtype=torch.uint8))
    assert unpack_ternary(torch.tensor([[0b10_01_00_10]], dtype=torch.uint8)).flatten().tolist() == [1, -1, 0, 1]


@pytest.mark.parametrize("shape", [{}, {"num_key_value_heads": 1, "intermediate_size": 96, "hidden_size": 48}])
def test_bitnet_matches_transformers(tmp_path, engine_for, shape):
    model = _load(bitnet_checkpoint(str(tmp_path), seed=1, **shape))
    rng = random.Random(0)
    work = [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], m) for n, m in _LENGTHS]
    expected = [hf_greedy(model, prompt, n) for prompt, n in work]
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    assert engine.runner.decoder is not None, "served by the lean decoder"
    assert isinstance(engine.runner.decoder.layers[0].qkv, TernaryLinear)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    assert [o.output_token_ids for o in engine.generate([p for p, _ in work], params)] == expected


@pytest.mark.parametrize("mode", ["int8", "gguf"])  # gguf: only a BitNet GGUF's head (test_bitnet_gguf_head.py)
def test_bitnet_refuses_its_own_quantization(bitnet_dir, engine_for, mode):
    with pytest.raises(UnsupportedArchitecture, match="ternary"):
        engine_for(_load(bitnet_dir), quantization=mode)


def test_bitnet_loads_from_its_directory(bitnet_dir, tokenizer, tmp_path):
    """Engine.from_pretrained on a packed checkpoint: transformers' BitNet loader, then the lean
    decoder over the ternary weights (two bits a weight where the C++ kernel runs, else int8: never
    floats); the answer of the model loaded by hand."""
    import shutil

    from orcaserve.scheduler import Engine

    folder = shutil.copytree(bitnet_dir, tmp_path / "bitnet")
    tokenizer.save_pretrained(folder)
    engine = Engine.from_pretrained(str(folder), dtype="float32", max_num_seqs=2, kv_cache_memory=4 << 20)
    layer = engine.runner.decoder.layers[0]
    assert isinstance(layer.gate_up, TernaryLinear) and layer.gate_up.weight.dtype in (torch.int8, torch.uint8)
    prompt = [7, 99, 300, 41, 5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert engine.generate([prompt], [params])[0].output_token_ids == hf_greedy(_load(bitnet_dir), prompt, 12)


def test_autobitlinear_is_refused_at_load(tmp_path, engine_for):
    """AutoBitLinear quantizes activations in floats, in another order: refused, never approximated."""
    model = _load(bitnet_checkpoint(str(tmp_path), linear_class="autobitlinear"))
    with pytest.raises(ValueError, match="autobitlinear"):
        engine_for(model)


def test_lora_over_bitnet_is_refused(bitnet_dir, engine_for, tmp_path):
    """No test holds an adapter's update beside the ternary layers: refused before it loads."""
    from orcaserve.scheduler.lora.config import LoraUnsupported

    with pytest.raises(LoraUnsupported, match="BitNet"):
        engine_for(_load(bitnet_dir), lora_adapters={"a": str(tmp_path)})

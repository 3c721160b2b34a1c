"""BitNet from llama.cpp's ternary GGUF files (TQ1_0, TQ2_0): a tiny packed checkpoint written by
gguf-py's writer and quantize functions (benchmarks/models/bitnet_gguf.py) reads back to the same
BitLinear weights bit for bit and is served token-exact against transformers' fp32 forward on the
checkpoint; a file whose blocks are not one scale times {-1, 0, +1} is refused, naming the tensor
(docs/bitnet.md, "GGUF files")."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from cpu_variants import variants
from test_bitnet import _load, eager_bitlinear  # noqa: F401  (the fixture)

from orcaserve.bench.models.bitnet_gguf import write_bitnet_gguf
from orcaserve.bench.models.tiny import TINY_VOCAB, bitnet_checkpoint, hf_greedy
from orcaserve.kernels.ternary import TernaryLinear
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.bitnet_gguf import load_bitnet_gguf

# A TQ block is 256 weights of one row: every projection's input width a multiple of 256.
_SHAPE = {"hidden_size": 256, "intermediate_size": 512}
# The ternary GEMM's ISA variants this machine executes, and the twin
ISAS = ["generic", *variants("linear_ternary")]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A packed checkpoint whose weight scales are powers of two: 1 / fp16(1 / s) == s, so the
    file's one scale per tensor is the checkpoint's, exactly."""
    from safetensors.torch import load_file, save_file

    folder = bitnet_checkpoint(str(tmp_path_factory.mktemp("bitnet")), seed=1, **_SHAPE)
    file = os.path.join(folder, "model.safetensors")
    state = load_file(file)
    for key in [k for k in state if k.endswith(".weight_scale")]:
        state[key] = torch.exp2(torch.log2(state[key]).round())
    save_file(state, file, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=["TQ1_0", "TQ2_0"])
def gguf_file(request, source, tmp_path_factory):
    return write_bitnet_gguf(source, str(tmp_path_factory.mktemp("gguf") / f"m.{request.param}.gguf"), request.param)


def test_gguf_reads_to_the_checkpoints_weights(source, gguf_file):
    from safetensors.torch import load_file

    expected = load_file(os.path.join(source, "model.safetensors"))
    got = load_bitnet_gguf(gguf_file).state_dict()
    assert set(got) == set(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


_EXPECTED: dict[str, tuple[list, list]] = {}


def _expected(source: str) -> tuple[list, list]:
    """Prompts across block and chunk boundaries and transformers' fp32 greedy tokens on them,
    once a module (computed inside a test: BitLinear run eagerly)."""
    if source not in _EXPECTED:
        reference = _load(source)
        rng = random.Random(0)
        work = [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], m) for n, m in [(1, 8), (40, 12), (90, 10)]]
        _EXPECTED[source] = work, [hf_greedy(reference, prompt, n) for prompt, n in work]
    return _EXPECTED[source]


@pytest.mark.parametrize("isa", ISAS)
def test_gguf_served_token_exact(source, gguf_file, engine_for, monkeypatch, isa):
    """Through every ISA variant of the ternary GEMM this CPU runs (`generic`: the PyTorch twin)."""
    work, expected = _expected(source)
    monkeypatch.setenv("ORCASERVE_CPU_ISA", isa)
    engine = engine_for(load_bitnet_gguf(gguf_file), max_num_seqs=3, max_num_batched_tokens=64, block_size=16)
    layer = engine.runner.decoder.layers[0].gate_up
    assert isinstance(layer, TernaryLinear)
    assert layer.kernel == ("torch" if isa == "generic" else f"orcaserve.linear_ternary.{isa}")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    assert [o.output_token_ids for o in engine.generate([p for p, _ in work], params)] == expected


def test_engine_loads_a_bitnet_gguf(source, smollm2_path, tmp_path):
    """Engine.from_pretrained on the .gguf path: its tokenizer from the file's metadata, the model
    through bitnet_gguf, the answer of transformers on the source checkpoint."""
    from orcaserve.scheduler import Engine

    path = write_bitnet_gguf(source, str(tmp_path / "m.gguf"), "TQ1_0", tokenizer_from=smollm2_path)
    engine = Engine.from_pretrained(path, dtype="float32", max_num_seqs=2, kv_cache_memory=4 << 20)
    assert engine.tokenizer("The capital of France").input_ids == [504, 3575, 282, 4649]
    prompt = [7, 99, 300, 41, 5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert engine.generate([prompt], [params])[0].output_token_ids == hf_greedy(_load(source), prompt, 12)


def test_config_from_metadata(source, tmp_path):
    """llama.cpp's bitnet metadata keys mapped to the config; no output tensor: tied embeddings."""
    model = load_bitnet_gguf(write_bitnet_gguf(source, str(tmp_path / "tied.gguf"), "TQ2_0", tied=True))
    ref = _load(source).config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(model.config, field) == getattr(ref, field), field
    assert model.config.num_key_value_heads == ref.num_key_value_heads
    assert model.config.rms_norm_eps == ref.rms_norm_eps
    assert model.config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def _edit(path: str, out: str, tensor: str, edit) -> str:
    """A copy of GGUF `path` at `out` with `edit(blocks)` applied to `tensor`'s raw blocks in place."""
    from gguf import GGUFReader

    shutil.copy(path, out)
    reader = GGUFReader(out, "r+")
    edit(next(t for t in reader.tensors if t.name == tensor).data)
    reader.data.flush()
    return out


def test_tq2_code_of_three_is_refused(source, tmp_path):
    path = write_bitnet_gguf(source, str(tmp_path / "m.gguf"), "TQ2_0")

    def three(blocks: np.ndarray) -> None:
        blocks[0, 0] = 0xFF  # four codes of 3: the value 2

    bad = _edit(path, str(tmp_path / "bad.gguf"), "blk.1.ffn_up.weight", three)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*outside"):
        load_bitnet_gguf(bad)


@pytest.mark.parametrize("qtype", ["TQ1_0", "TQ2_0"])
def test_differing_scales_are_refused(source, tmp_path, qtype):
    path = write_bitnet_gguf(source, str(tmp_path / "m.gguf"), qtype)

    def rescale(blocks: np.ndarray) -> None:  # the second block's d (its last two bytes) doubled
        flat = blocks.reshape(-1, 66 if qtype == "TQ2_0" else 54)
        flat[1, -2:] = (flat[1, -2:].view(np.float16) * 2).view(np.uint8)

    bad = _edit(path, str(tmp_path / "bad.gguf"), "blk.0.attn_q.weight", rescale)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*one finite positive scale"):
        load_bitnet_gguf(bad)


def test_float_projections_are_refused(source, tmp_path):
    """A BitNet GGUF with float projections (llama.cpp's `--outtype f32`): not the ternary codes
    this loader serves, refused with the tensor's name rather than served as floats."""
    path = write_bitnet_gguf(source, str(tmp_path / "f32.gguf"), "F32")
    with pytest.raises(ValueError, match=r"blk\.0\.\w+\.weight is F32"):
        load_bitnet_gguf(path)

"""A BitNet GGUF whose lm_head is in a block type (llama-quantize writes a TQ file's output tensor,
or its tied embedding, as Q6_K): with `quantization: gguf` (the default for such a file) the
ternary projections are served as always and the head from the file's own blocks, a QuantLinear;
token-exact against transformers' fp32 forward of the file's model with fp32 activations, and with
int8 activations the C++ kernels' tokens are their PyTorch twin's (docs/bitnet.md, "A quantized
lm_head")."""

from __future__ import annotations

import random

import pytest
import torch
from cpu_variants import variants
from test_bitnet import eager_bitlinear  # noqa: F401  (the fixture)
from test_bitnet_gguf import source  # noqa: F401  (the fixture)

from orcaserve.bench.models.bitnet_gguf import write_bitnet_gguf
from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy
from orcaserve.kernels.quant import QuantLinear, dequantize
from orcaserve.kernels.ternary import TernaryLinear
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.bitnet_gguf import load_bitnet_gguf
from orcaserve.scheduler.model.quantized import CODES

HEADS = [("Q6_K", True), ("Q8_0", False)]  # llama-quantize's default (tied: the embedding), and untied Q8_0
_WORK = [(n, m) for n, m in [(1, 8), (40, 12), (90, 10)]]


@pytest.fixture(scope="module", params=HEADS, ids=[h for h, _ in HEADS])
def head_file(request, source, tmp_path_factory):  # noqa: F811
    qtype, tied = request.param
    out = str(tmp_path_factory.mktemp("gguf") / f"m.tq2_0-{qtype}.gguf")
    return write_bitnet_gguf(source, out, "TQ2_0", tied=tied, embed="F16", head=qtype), qtype.lower()


def _prompts() -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], m) for n, m in _WORK]


def _generate(engine, work) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    return [o.output_token_ids for o in engine.generate([p for p, _ in work], params)]


def test_head_codes_are_the_files_weights(head_file):
    path, fmt = head_file
    dense = load_bitnet_gguf(path)
    quantized = load_bitnet_gguf(path, quantization="gguf")
    codes = getattr(quantized.lm_head, CODES)
    assert codes.fmt == fmt
    assert torch.equal(dequantize(codes), dense.lm_head.weight)
    assert torch.equal(quantized.model.embed_tokens.weight, dense.model.embed_tokens.weight)  # stays dense


def test_served_token_exact_with_fp32_activations(head_file, engine_for):
    path, _ = head_file
    reference = load_bitnet_gguf(path)  # transformers' forward, the head dequantized
    reference.generation_config.eos_token_id = None
    work = _prompts()
    expected = [hf_greedy(reference, prompt, n) for prompt, n in work]
    model = load_bitnet_gguf(path, quantization="gguf")
    engine = engine_for(model, quantization="gguf", max_num_seqs=3, max_num_batched_tokens=64, block_size=16)
    decoder = engine.runner.decoder
    assert isinstance(decoder.lm_head, QuantLinear) and isinstance(decoder.layers[0].gate_up, TernaryLinear)
    assert _generate(engine, work) == expected


@pytest.mark.slow  # an engine per ISA variant
def test_int8_activations_match_the_twin(head_file, engine_for, monkeypatch):
    """The head's int8 GEMM and the ternary GEMM through every ISA variant this CPU runs give the
    PyTorch twins' tokens (`generic`)."""
    path, _ = head_file
    model = load_bitnet_gguf(path, quantization="gguf")
    work = _prompts()
    got = {}
    for isa in ["generic", *variants("linear_int8")]:
        monkeypatch.setenv("ORCASERVE_CPU_ISA", isa)
        engine = engine_for(model, quantization="gguf", activations="int8", max_num_seqs=3, block_size=16)
        got[isa] = _generate(engine, work)
    assert all(tokens == got["generic"] for tokens in got.values()), got


@pytest.mark.slow  # four engines, the tokenizer built from each file's metadata
def test_engine_defaults_to_the_files_head(head_file, smollm2_path, tmp_path, source):  # noqa: F811
    """Engine.from_pretrained on a file with a block-type head chooses quantization gguf with int8
    activations; the same weights with an F16 head stay dense (quantization none)."""
    from orcaserve.scheduler import Engine

    _, fmt = head_file
    tied = fmt == "q6_k"
    for head, want in ((fmt.upper(), QuantLinear), (None, None)):
        path = write_bitnet_gguf(
            source, str(tmp_path / f"{head}.gguf"), "TQ2_0", tied=tied, tokenizer_from=smollm2_path, head=head
        )
        engine = Engine.from_pretrained(path, dtype="float32", max_num_seqs=2, kv_cache_memory=4 << 20)
        lm_head = engine.runner.decoder.lm_head
        assert engine.config.quantization == ("gguf" if want else "none")
        assert isinstance(lm_head, QuantLinear) if want else not isinstance(lm_head, QuantLinear)
        if want:
            assert lm_head.activations == "int8"


def test_other_quantization_on_bitnet_is_refused(head_file, engine_for):
    path, _ = head_file
    with pytest.raises(ValueError, match="BitNet"):
        engine_for(load_bitnet_gguf(path, quantization="int8"), quantization="int8")

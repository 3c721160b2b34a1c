"""A BitNet GGUF whose token list has exactly its head's rows, as llama.cpp requires to load it:
SmolLM2's tokenizer grown by merges of its own tokens (benchmarks/models/vocab.py), read by
transformers' GGUF tokenizer builder and, where benchmarks/peers/setup_llamacpp.sh has built it,
served by llama.cpp's server (docs/bitnet.md, "GGUF files")."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import requests

from orcaserve.bench.models.bitnet_gguf import write_bitnet_gguf
from orcaserve.bench.models.tiny import bitnet_checkpoint
from orcaserve.bench.models.vocab import grown_merges, vocab_gguf

_SIZE = 49152 + 1000  # SmolLM2's tokens and 1000 grown ones


@pytest.fixture(scope="module")
def vocab(tmp_path_factory, smollm2_path) -> str:
    return vocab_gguf(_SIZE, str(tmp_path_factory.mktemp("vocab") / "vocab.gguf"), smollm2_path)


@pytest.fixture(scope="module")
def bitnet_file(vocab, tmp_path_factory) -> str:
    # Written tied (the head is the embedding), as llama.cpp's bitnet tensor list has no output
    # tensor: it refuses a file with one.
    folder = bitnet_checkpoint(
        str(tmp_path_factory.mktemp("bitnet")), vocab_size=_SIZE, hidden_size=256, intermediate_size=512
    )
    out = str(Path(folder) / "m.tq2_0.gguf")
    return write_bitnet_gguf(folder, out, "TQ2_0", tied=True, tokenizer_from=vocab, embed="F16")


def test_grown_merges_are_new_tokens_of_old_ones():
    tokens = ["a", "b", "Ġa", "Ġab", "ab", "cd", "Ġ"]
    merges = grown_merges(tokens, 10)
    made = [a + b for a, b in merges]
    assert len(merges) == 3 and len(set(made)) == 3 and not set(made) & set(tokens)
    assert all(a in tokens and b in tokens for a, b in merges)
    with pytest.raises(ValueError, match="grows only"):
        grown_merges(tokens, 5)
    with pytest.raises(ValueError, match="can be grown"):
        grown_merges(tokens, 1000)


# The two below grow and read SmolLM2's whole 49k-token list (GGUF parsing in Python, ~20 s of
# set-up and reads): the files feed llama.cpp's BitNet runs (slow, below); the full suite runs them.
@pytest.mark.slow
def test_grown_tokenizer_encodes_as_smollm2(vocab):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(vocab), gguf_file=os.path.basename(vocab))
    assert len(tok) == _SIZE
    assert tok("The capital of France").input_ids == [504, 3575, 282, 4649]  # SmolLM2's ids
    last = str(tok.convert_ids_to_tokens(_SIZE - 1))
    assert tok.convert_tokens_to_ids(last) == _SIZE - 1 and last.startswith("Ġ")


@pytest.mark.slow
def test_file_vocabulary_and_embedding_agree(bitnet_file):
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(bitnet_file)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == _SIZE
    assert len(reader.fields["tokenizer.ggml.token_type"].contents()) == _SIZE
    assert reader.fields["bitnet.vocab_size"].contents() == _SIZE
    assert int(embd.shape[-1]) == _SIZE and embd.tensor_type == GGMLQuantizationType.F16  # ggml order: [K, N]


@pytest.mark.slow
def test_llamacpp_serves_the_file(bitnet_file):
    """llama.cpp's server loads the file (it refuses an embedding whose rows differ from the token
    list) and generates from it."""
    from orcaserve.bench.peers.llamacpp import BIN, llamacpp_env
    from orcaserve.bench.peers.parts import running
    from orcaserve.bench.serve.harness import free_ports

    if not (BIN / "llama-server").exists():
        pytest.skip("llama.cpp's server is not built (benchmarks/peers/setup_llamacpp.sh)")
    [port] = free_ports(1)
    cmd = [str(BIN / "llama-server"), "-m", bitnet_file, "-c", "256", "-t", "1", "--port", str(port), "--no-ui"]
    work = Path(tempfile.mkdtemp(prefix="orcaserve-bitnet-vocab-"))
    with running("llamacpp-bitnet", cmd + ["--host", "127.0.0.1"], llamacpp_env(), port, "/health", work, 300):
        body = {"prompt": [1, 504, 3575, 282, 4649], "n_predict": 4, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120)
        r.raise_for_status()
        assert r.json()["tokens_predicted"] == 4

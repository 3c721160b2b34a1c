"""llama.cpp's TQ1_0 / TQ2_0 blocks decoded in integers (scheduler/model/ternary_blocks.py): the
codes of gguf-py's `dequantize` (the oracle, its scales set to 1) for every byte value, and the
packing of transformers' `pack_weights`, odd row counts included (docs/bitnet.md, "GGUF files")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orcaserve.scheduler.model.ternary_blocks import BLOCK, SIZES, block_scales, pack_rows, unsigned_codes


def _random_blocks(kind: str, n: int, seed: int) -> np.ndarray:
    """n blocks of random bytes (every byte value, TQ2_0's code 3 among them), each d a random fp16."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, SIZES[kind]), dtype=np.uint8)
    d = rng.uniform(0.01, 4, n).astype(np.float16)
    blocks[:, -2:] = d.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0"])
def test_codes_are_gguf_pys(kind):
    from gguf import GGMLQuantizationType, dequantize

    blocks = _random_blocks(kind, 64, seed=len(kind))
    blocks[0, : SIZES[kind] - 2] = np.arange(SIZES[kind] - 2, dtype=np.uint8) * 5  # spread byte values
    ones = blocks.copy()
    ones[:, -2:] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    expected = dequantize(ones, GGMLQuantizationType[kind]).reshape(-1, BLOCK)
    got = unsigned_codes(blocks, kind)
    assert got.dtype == np.uint8 and got.shape == (64, BLOCK)
    assert np.array_equal(got.astype(np.float32) - 1, expected)
    assert np.array_equal(block_scales(blocks), blocks[:, -2:].copy().view(np.float16)[:, 0].astype(np.float32))


def test_tq1_digits_stay_ternary():
    """Every TQ1_0 byte value gives digits in {0, 1, 2}: only TQ2_0 can hold a code of 3."""
    blocks = np.zeros((256, SIZES["TQ1_0"]), dtype=np.uint8)
    blocks[:, :52] = np.arange(256, dtype=np.uint8)[:, None]
    assert unsigned_codes(blocks, "TQ1_0").max() == 2


@pytest.mark.parametrize("rows", [4, 12, 13, 15, 1])
def test_packing_is_transformers(rows):
    from transformers.integrations.bitnet import pack_weights

    codes = torch.randint(-1, 2, (rows, 24), generator=torch.Generator().manual_seed(rows), dtype=torch.int8)
    expected = pack_weights(codes.clone())
    assert np.array_equal(pack_rows((codes + 1).to(torch.uint8).numpy()), expected.numpy())


def test_other_kinds_are_refused():
    with pytest.raises(ValueError, match="Q4_0 is not a ternary block type"):
        unsigned_codes(np.zeros((1, 18), dtype=np.uint8), "Q4_0")

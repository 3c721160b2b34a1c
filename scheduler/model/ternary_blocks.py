"""llama.cpp's ternary GGUF blocks, TQ1_0 and TQ2_0, decoded in integers straight into the packed
BitNet weight transformers' `BitLinear` holds (docs/bitnet.md, "GGUF files").

A block holds 256 weights of one row and an fp16 scale `d` in its last two bytes; a weight is
`d * code`, code in {-1, 0, +1}, stored as the unsigned `code + 1` in {0, 1, 2}:

- TQ2_0 (66 bytes, 2.06 bits a weight): 64 bytes `qs`; bits 2 l..2 l + 1 of byte 32 g + m hold
  weight 128 g + 32 l + m (ggml's `dequantize_row_tq2_0`). A code of 3 is no ternary value.
- TQ1_0 (54 bytes, 1.69 bits a weight): 48 bytes `qs`, then 4 bytes `qh`, five (four in `qh`)
  base-3 digits a byte as a fixed-point fraction: digit n of byte b is `((b * 3^n mod 256) * 3)
  >> 8`, always in {0, 1, 2}. Digit n of `qs[m]` is weight 32 n + m for m < 32, of `qs[32 + m]`
  weight 160 + 16 n + m, of `qh[j]` weight 240 + 4 n + j (ggml's `dequantize_row_tq1_0`).

The digits come from a 256-entry table, so a tensor's decoding is a gather and a few byte copies,
one byte a weight at most: never floats. transformers' packing then puts four output rows in a
byte (the i-th quarter of the rows in bits 2 i..2 i + 1), which is what a packed checkpoint holds
and what the kernels repack from: a TQ1_0 weight served takes 2 bits where its file has 1.69.
gguf-py's `dequantize` of the same blocks is the oracle (`tests/model/test_ternary_blocks.py`),
and transformers' `pack_weights` the packing's: called instead of `pack_rows` on the 2B4T's largest
projection ([6912, 2560]) it took 104-111 ms of CPU against 9-13 (AMD EPYC Zen 5, 2026-12-07:
its codes shifted to int8 and back, its packing in torch ops; beside a running test suite).
"""

from __future__ import annotations

import numpy as np

BLOCK = 256  # weights a block
SIZES = {"TQ1_0": 54, "TQ2_0": 66}  # bytes a block
VALUES_PER_BYTE = 4  # transformers' packing, along the output rows

_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
# _DIGITS[b, n]: base-3 digit n of byte b in TQ1_0's fixed point, as ggml reads it (uint8 wraps)
_DIGITS = (((np.arange(256, dtype=np.uint8)[:, None] * _POW3[None, :]).astype(np.uint16) * 3) >> 8).astype(np.uint8)
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def block_scales(blocks: np.ndarray) -> np.ndarray:
    """[B] fp32: each block's `d`, its last two bytes."""
    return np.ascontiguousarray(blocks[:, -2:]).view(np.float16)[:, 0].astype(np.float32)


def unsigned_codes(blocks: np.ndarray, kind: str) -> np.ndarray:
    """[B, 256] uint8 `code + 1` of [B, size] uint8 blocks of `kind` (TQ1_0 or TQ2_0); a TQ2_0
    block may give 3, which the caller refuses."""
    n = blocks.shape[0]
    if kind == "TQ2_0":
        qs = blocks[:, :64].reshape(n, 2, 1, 32)
        return ((qs >> _SHIFTS) & 3).reshape(n, BLOCK)
    if kind != "TQ1_0":
        raise ValueError(f"{kind} is not a ternary block type (TQ1_0, TQ2_0)")
    parts = (
        _DIGITS[blocks[:, :32]].transpose(0, 2, 1),  # [B, 5, 32]: weights 0..159
        _DIGITS[blocks[:, 32:48]].transpose(0, 2, 1),  # [B, 5, 16]: 160..239
        _DIGITS[blocks[:, 48:52], :4].transpose(0, 2, 1),  # [B, 4, 4]: 240..255
    )
    return np.concatenate([p.reshape(n, -1) for p in parts], axis=1)


def pack_rows(unsigned: np.ndarray) -> np.ndarray:
    """[ceil(N/4), K] uint8 of [N, K] uint8 codes + 1, as transformers' `pack_weights` packs the
    codes: the i-th quarter of the rows (of ceil(N/4) each, the last one padded with 0) in bits
    2 i..2 i + 1."""
    n, k = unsigned.shape
    rows = -(-n // VALUES_PER_BYTE)
    packed = np.zeros((rows, k), dtype=np.uint8)
    for i in range(VALUES_PER_BYTE):
        part = unsigned[i * rows : min((i + 1) * rows, n)]
        packed[: part.shape[0]] |= part << np.uint8(2 * i)
    return packed

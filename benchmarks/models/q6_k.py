"""GGUF Q6_K blocks of an fp32 tensor, for test files (gguf-py quantizes no K-quant).

A Q6_K super-block is 256 weights of one row in 210 bytes: 128 bytes of low nibbles, 64 of 2-bit
highs, 16 int8 scales (one per 16 weights) and an fp16 `d`; weight e is `d * sc[e // 16] * (u - 32)`
with the 6-bit code `u` (ggml-common.h's block_q6_K; the layout gguf-py's and the project's readers
decode: scheduler/model/gguf_blocks.py). The scales here are the plain absmax ones (`sc` the 16's
absmax over 31, `d` the block's largest over 127), not ggml's searched ones: any valid blocks do
for a test file, which serves what its blocks hold.
"""

from __future__ import annotations

import numpy as np

QK = 256
BLOCK_BYTES = 210


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K a multiple of 256) -> [N, K / 256 * 210] uint8 Q6_K blocks."""
    n, k = x.shape
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK // 16, 16)  # [nb, 16 groups, 16]
    nb = blocks.shape[0]
    scale = np.abs(blocks).max(axis=-1) / 31  # [nb, 16]
    d = (scale.max(axis=-1, keepdims=True) / 127).astype(np.float16)  # [nb, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d == 0, 0, np.round(scale / d.astype(np.float32))).clip(-128, 127).astype(np.int8)
        step = (d.astype(np.float32) * sc.astype(np.float32))[..., None]  # [nb, 16, 1]
        q = np.where(step == 0, 0, np.round(blocks / step)).clip(-32, 31)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(nb, QK)  # element e = 128 h + ...
    low, high = u & np.uint8(0x0F), u >> np.uint8(4)
    low = low.reshape(nb, 2, 2, 64)  # e = 128 h + 64 s + j: ql[64 h + j] >> 4 s
    ql = (low[:, :, 0] | (low[:, :, 1] << np.uint8(4))).reshape(nb, 128)
    high = high.reshape(nb, 2, 4, 32)  # e = 128 h + 32 t + i: qh[32 h + i] >> 2 t
    qh = sum((high[:, :, t] << np.uint8(2 * t) for t in range(4)), np.zeros((nb, 2, 32), np.uint8))
    out = np.concatenate([ql, qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8)], axis=-1)
    return out.reshape(n, k // QK * BLOCK_BYTES)

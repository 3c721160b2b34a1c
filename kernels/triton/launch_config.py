"""Host-side launch decisions of the attention kernels: tile sizes and the split-K count.

Nothing here launches a kernel or reads a device tensor, so it runs without a GPU (the split
heuristic's test replays the measured table through it on the CPU).

Tile configurations (`select_config`):
    decode  (max_seqlen_q * G <= 16): BLOCK_M = max(16, next_pow2(G)), TILE_N = 64, 4 warps
    prefill (otherwise):              BLOCK_M = max(64, next_pow2(G)), TILE_N = 64, 8 warps
    fp32 (the CPU path's dtype; exact "ieee" dots run on FMA units, so smaller tiles):
                                      BLOCK_M = 16 / 32 (decode / prefill), TILE_N = 32, 8 warps
BLOCK_M >= 16 and TILE_N >= 16 keep every tl.dot legal on sm_80 / sm_90.

Split-K (`choose_num_splits`), see docs/kernels.md#split-k-heuristic-refitted-on-the-h200.
Decode steps (max_seqlen_q == 1, fp16/bf16), fitted to the measured table that section cites:
    P = B * H_kv programs (one per request and KV head)
    if max_seqlen_k < 4096: 1              (at 1k-2k one split won at every batch: the split
                                            path's extra launch and partial write cost more)
    else: the largest power of two <= 6 * num_SMs / P, i.e. 3-6 programs per SM in all,
          capped so each split still reads >= 64 KiB of K per KV head (256 keys at head_dim
          128 bf16, 512 at 64) and at SPLIT_MAX.
At P > 3 * num_SMs this is 1, as before: nothing changes at batch >= 128 on the 8-KV-head layout.
Other steps (prefill rows, fp32) keep the first-guess rule, for which nothing is measured yet:
    programs = (T // BLOCK_Q + B) * H_kv; 1 if max_seqlen_k < 2048 or programs >= num_SMs,
    else min(ceil(4 * num_SMs / programs), max_seqlen_k // 512, SPLIT_MAX).
num_SMs is read from the CUDA device (132 assumed without one).
"""

from __future__ import annotations

import functools

import torch
import triton

SPLIT_MAX = 64
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM

# Decode steps: fitted to the measured table (docs/kernels.md#split-k-heuristic-refitted-on-the-h200).
DECODE_MIN_CONTEXT = 4096
DECODE_PROGRAMS_PER_SM = 6  # splits = pow2 floor of this * SMs / P: 3-6 programs per SM in all
DECODE_MIN_SPLIT_BYTES = 64 * 1024  # K bytes per split and KV head

# Other steps: the first guesses (no measurement yet).
SPLIT_MIN_CONTEXT = 2048
SPLIT_MIN_KEYS = 512
SPLIT_TARGET_WAVES = 4


def select_config(max_seqlen_q: int, num_queries_per_kv: int, dtype=torch.float16) -> dict:
    """Tile sizes and launch options; see the module docstring."""
    g_pad = triton.next_power_of_2(num_queries_per_kv)
    decode = max_seqlen_q * num_queries_per_kv <= 16
    if dtype == torch.float32:
        # fp32 "ieee" dots run on FMA units and hold whole tiles in registers: small tiles.
        return dict(block_m=max(16 if decode else 32, g_pad), tile_n=32, num_warps=8, num_stages=1)
    if decode:
        return dict(block_m=max(16, g_pad), tile_n=64, num_warps=4, num_stages=2)
    return dict(block_m=max(64, g_pad), tile_n=64, num_warps=8, num_stages=2)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def choose_num_splits(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    num_queries_per_kv: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sms: int = DEFAULT_NUM_SMS,
    dtype: torch.dtype = torch.float16,
    head_dim: int = 128,
) -> int:
    """Number of key splits for a step (1 = unified kernel); see the module docstring."""
    if max_seqlen_q == 1 and dtype != torch.float32:
        if max_seqlen_k < DECODE_MIN_CONTEXT:
            return 1
        want = DECODE_PROGRAMS_PER_SM * sms // max(1, num_seqs * num_kv_heads)
        min_keys = max(1, DECODE_MIN_SPLIT_BYTES // (head_dim * dtype.itemsize))
        return max(1, min(_pow2_floor(want), _pow2_floor(max_seqlen_k // min_keys), SPLIT_MAX))
    if max_seqlen_k < SPLIT_MIN_CONTEXT:
        return 1
    block_q = select_config(max_seqlen_q, num_queries_per_kv, dtype)["block_m"] // num_queries_per_kv
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    if programs >= sms:
        return 1
    splits = min(
        triton.cdiv(SPLIT_TARGET_WAVES * sms, programs),
        max_seqlen_k // SPLIT_MIN_KEYS,
        SPLIT_MAX,
    )
    return max(1, splits)

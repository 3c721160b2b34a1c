"""Triton paged attention for ORCA's merged steps: prefill chunks and decodes in one launch.

`store_kv` and `unified_attention` take the same positional arguments as their PyTorch twins in
`orcaserve.kernels.pytorch.attention` (which are also their test oracle).

Unified kernel (`_unified_attention_kernel`): grid (T // BLOCK_Q + B, H_kv). A program owns one
query tile (BLOCK_Q new tokens of one request x the G query heads of one KV head, see
`common`), finds its request by binary search over cu_seqlens_q, and walks the request's
keys in TILE_N-key tiles through the block table with an fp32 online softmax, causal per request:
new token j of request b sits at position seq_lens[b] - q_len_b + j and sees keys 0 ..= that
position. Requests with zero new tokens own one program that exits at once. Head dims that are
not a power of two (80, 96) are padded to the next one with masks; TILE_N does not depend on the
cache block size, so any power-of-two block_size works (one table lookup per key).

Tile configurations (`select_config`) and the split-K count (`choose_num_splits`) are host-side
decisions in `launch_config`: when a step has few programs (B * H_kv small next to the SM count)
and long contexts, the keys are split (flash-decoding, `split_k`) so the GPU is not mostly idle.

Host syncs: none when the caller passes max_seqlen_q / max_seqlen_k (the backend does);
otherwise they are read from the tensors once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orcaserve.kernels.triton.common import attend_q_tile, locate_q_tile
from orcaserve.kernels.triton.launch_config import SPLIT_MAX, choose_num_splits, num_sms, select_config
from orcaserve.kernels.triton.split_k import launch_split_k
from orcaserve.kernels.triton.store_kv import store_kv

__all__ = ["store_kv", "unified_attention", "choose_num_splits", "select_config", "num_sms", "SPLIT_MAX"]


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    out_ptr,  # [T, H, D]
    scale_log2,
    num_seqs,
    num_queries_per_kv,
    block_size,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    block_q = BLOCK_M // num_queries_per_kv
    seq_idx, q_start, q_len, q_tile_start = locate_q_tile(cu_seqlens_q_ptr, q_tile_idx, num_seqs, block_q)
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)

    acc, l_i, m_i, tok, head, row_ok = attend_q_tile(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_idx,
        q_start,
        q_len,
        seq_len,
        q_tile_start,
        kv_head,
        0,
        1,
        num_queries_per_kv,
        block_q,
        scale_log2,
        block_size,
        stride_qt,
        stride_qh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        HEAD_DIM,
        D_PAD,
        BLOCK_M,
        TILE_N,
    )
    # Padding rows never saw a key (l = 0); keep them finite, they are masked on the store.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, D_PAD]
    d = tl.arange(0, D_PAD)
    out_off = tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(
        out_ptr + out_off,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
    )


def launch_unified(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    seq_lens,
    block_tables,
    scale,
    out,
    block_m: int,
    tile_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """The unified kernel with explicit tiles (tests use big tiles to keep the interpreter fast)."""
    t, h, d = q.shape
    n_kv = k_cache.shape[2]
    g = h // n_kv
    b = seq_lens.shape[0]
    block_q = block_m // g
    grid = (t // block_q + b, n_kv)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        out,
        scale * 1.4426950408889634,
        b,
        g,
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
        BLOCK_M=block_m,
        TILE_N=tile_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def unified_attention(
    q: torch.Tensor,  # [T, H, D] packed queries of all requests
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], this step's K/V already stored
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Ragged paged attention, causal per request; split-K when `choose_num_splits` says so."""
    t, h, d = q.shape
    _, block_size, n_kv, d_cache = k_cache.shape
    if h % n_kv or d_cache != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head dim")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if out is None:
        out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    o = out if out.stride(2) == 1 else torch.empty_like(q)
    g = h // n_kv
    if max_seqlen_q is None and (num_splits is None or t > b):
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    elif max_seqlen_q is None:
        max_seqlen_q = 1  # t <= b: only the tile shape depends on it, any value is exact
    if num_splits is None:
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max())
        num_splits = choose_num_splits(
            t, b, n_kv, g, max_seqlen_q, max_seqlen_k, num_sms(q.device), q.dtype, head_dim=d
        )
    cfg = select_config(max_seqlen_q, g, q.dtype)
    if num_splits > 1:
        launch_split_k(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, o, num_splits, **cfg)
    else:
        launch_unified(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, o, **cfg)
    if o is not out:
        out.copy_(o)
    return out

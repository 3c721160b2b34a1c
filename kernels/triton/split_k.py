"""Split-K (flash-decoding) attention: each query tile's keys are cut into `num_splits` ranges.

A decode step with few requests launches only B * H_kv programs in the unified kernel, each
walking a long context alone, which leaves most SMs idle. Here program (tile, kv_head, split)
attends to one contiguous range of key tiles and writes an unnormalised fp32 partial result with
its row max and row sum; `_reduce_splits_kernel` merges the partials per (token, head) with the
usual log-sum-exp rescaling. The kernel is exact for any step (prefill rows included), so the
choice between the paths (see `choose_num_splits` in launch_config.py) is purely about speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orcaserve.kernels.triton.common import NEG_BIG, attend_q_tile, locate_q_tile


@triton.jit
def _split_k_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    acc_ws_ptr,  # [num_splits, T, H, D_PAD] fp32, unnormalised
    m_ws_ptr,  # [num_splits, T, H] fp32, row max in log2 units
    l_ws_ptr,  # [num_splits, T, H] fp32, row sum
    scale_log2,
    num_seqs,
    num_tokens,
    num_heads,
    num_queries_per_kv,
    block_size,
    num_splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    q_tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_idx = tl.program_id(2)
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
        split_idx,
        num_splits,
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
    # Empty splits (short requests) still write m = NEG_BIG, l = 0 so the reduce can read all.
    row = (split_idx * num_tokens + tok).to(tl.int64) * num_heads + head  # [BLOCK_M]
    tl.store(m_ws_ptr + row, m_i, mask=row_ok)
    tl.store(l_ws_ptr + row, l_i, mask=row_ok)
    d = tl.arange(0, D_PAD)
    tl.store(acc_ws_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    acc_ws_ptr,  # [num_splits, T, H, D_PAD] fp32
    m_ws_ptr,  # [num_splits, T, H] fp32
    l_ws_ptr,
    out_ptr,  # [T, H, D]
    cu_seqlens_q_ptr,  # [B + 1] int32
    num_seqs,
    num_tokens,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    # Rows past the last request's queries (a CUDA graph's padding) have no partials: leave them.
    if tok >= tl.load(cu_seqlens_q_ptr + num_seqs):
        return
    d = tl.arange(0, D_PAD)
    m_run = tl.full([1], NEG_BIG, tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    # A running merge instead of a [num_splits, D_PAD] tile: one compiled variant for any split
    # count, and the partials are tiny next to the K/V they summarise.
    for s in range(num_splits):
        row = (s * num_tokens + tok).to(tl.int64) * num_heads + head
        m_s = tl.load(m_ws_ptr + row + tl.zeros([1], tl.int64))  # [1]
        l_s = tl.load(l_ws_ptr + row + tl.zeros([1], tl.int64))
        a_s = tl.load(acc_ws_ptr + row * D_PAD + d)  # [D_PAD]
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.math.exp2(m_run - m_new)
        beta = tl.math.exp2(m_s - m_new)
        acc = acc * alpha + a_s * beta
        l_run = l_run * alpha + l_s * beta
        m_run = m_new
    out = acc / l_run
    out_off = tok.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def launch_split_k(
    q: torch.Tensor,  # [T, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor,  # [T, H, D], last dim contiguous
    num_splits: int,
    block_m: int,
    tile_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    t, h, d = q.shape
    n_kv = k_cache.shape[2]
    g = h // n_kv
    b = seq_lens.shape[0]
    d_pad = triton.next_power_of_2(d)
    acc_ws = torch.empty(num_splits, t, h, d_pad, device=q.device, dtype=torch.float32)
    m_ws = torch.empty(num_splits, t, h, device=q.device, dtype=torch.float32)
    l_ws = torch.empty_like(m_ws)
    block_q = block_m // g
    grid = (t // block_q + b, n_kv, num_splits)
    _split_k_kernel[grid](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        acc_ws,
        m_ws,
        l_ws,
        scale * 1.4426950408889634,
        b,
        t,
        h,
        g,
        k_cache.shape[1],
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _reduce_splits_kernel[(t, h)](
        acc_ws,
        m_ws,
        l_ws,
        out,
        cu_seqlens_q,
        b,
        t,
        h,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        D_PAD=d_pad,
        num_warps=1 if d_pad <= 64 else 2,
    )
    return out

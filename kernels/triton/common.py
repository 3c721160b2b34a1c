"""Triton device functions shared by the unified and the split-K attention kernels.

Both kernels give one program a *query tile*: up to BLOCK_Q consecutive new tokens of one request
times the G = H // H_kv query heads that read the same KV head, i.e. BLOCK_M = BLOCK_Q * G rows
(rows past BLOCK_Q * G are padding when G does not divide BLOCK_M). Every K/V tile loaded from the
paged cache is therefore used by all G heads of its KV head (GQA/MQA sharing; MHA is G = 1).

Query tiles are numbered without a host sync: request b owns the tile indices starting at
`cu_seqlens_q[b] // BLOCK_Q + b`, which is strictly increasing in b and bounded by T // BLOCK_Q + B,
so a grid of T // BLOCK_Q + B programs covers every tile and a program finds its request by binary
search over cu_seqlens_q. Programs whose tile lies past their request's new tokens (at most one
per request, plus every program of a request with no new tokens) exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf as the running max: a row that sees no key in a tile (causal mask, or a
# padding row) then gives exp2(-inf - NEG_BIG) = 0 instead of exp2(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def find_seq_idx(cu_seqlens_q_ptr, q_tile_idx, num_seqs, block_q):
    """Largest b with cu_seqlens_q[b] // block_q + b <= q_tile_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // block_q + mid
        if start <= q_tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def locate_q_tile(cu_seqlens_q_ptr, q_tile_idx, num_seqs, block_q):
    """The request a query-tile program serves: (seq_idx, q_start, q_len, q_tile_start).

    Each request owns `q_len // block_q + 1` tile slots, so a program whose q_tile_start is at or
    past q_len has nothing to do and the caller returns.
    """
    seq_idx = find_seq_idx(cu_seqlens_q_ptr, q_tile_idx, num_seqs, block_q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    q_tile_start = (q_tile_idx - (q_start // block_q + seq_idx)) * block_q
    return seq_idx, q_start, q_len, q_tile_start


@triton.jit
def dot(a, b):
    # fp32 inputs: the PyTorch path computes in true fp32, so do not let tl.dot drop to tf32.
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def attend_q_tile(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_idx,
    q_start,  # first packed row of this request
    q_len,  # new tokens of this request
    seq_len,  # cached + new tokens
    q_tile_start,  # first new token (request-local) of this tile
    kv_head,
    split_idx,
    num_splits,
    num_queries_per_kv,  # G
    block_q,  # BLOCK_M // G
    scale_log2,  # softmax scale * log2(e): exp2 is the cheap exponential on GPUs
    block_size,
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
    """Online-softmax attention of one query tile over its split of the key tiles.

    Returns the unnormalised fp32 accumulator, the row sums and row maxima (log2 units) together
    with each row's packed token index, query head and validity.
    """
    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile_start + rows // num_queries_per_kv  # [BLOCK_M] request-local token
    head = kv_head * num_queries_per_kv + rows % num_queries_per_kv  # [BLOCK_M]
    row_ok = (rows // num_queries_per_kv < block_q) & (q_local < q_len)
    tok = q_start + q_local  # [BLOCK_M] packed row in q / out
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM  # head dims 80 and 96 are padded to 128

    q_off = tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]

    # New token j of the request sits at absolute position seq_len - q_len + j.
    context_len = seq_len - q_len
    q_pos = context_len + q_local  # [BLOCK_M]
    kv_end = context_len + tl.minimum(q_tile_start + block_q, q_len)  # keys any row may see
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split_idx * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_ch
    for t in range(tile_lo, tile_hi):
        kpos = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        # Keys past seq_len are never read: their slots (or whole blocks) may hold anything.
        k_ok = kpos < kv_end
        # One block-table entry per key keeps TILE_N independent of the cache block size.
        phys = tl.load(bt_row + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = phys * stride_cb + (kpos % block_size) * stride_cs + kv_head_off  # [TILE_N]
        k_t = tl.load(
            k_cache_ptr + slot[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0
        )  # [D_PAD, TILE_N]
        s = dot(q, k_t) * scale_log2  # [BLOCK_M, TILE_N] fp32
        visible = (kpos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0
        )  # [TILE_N, D_PAD]
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i, tok, head, row_ok

"""Scatter a step's new keys and values into the paged cache (Triton twin of torch_attention.store_kv).

Grid (cdiv(T, BLOCK_T), H_kv): a program copies BLOCK_T tokens of one KV head, K and V together.
Sources are addressed through all three strides, so slices of a fused qkv projection (or any
other view) are stored without a copy; the cast to the cache dtype happens in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens per program on a GPU: 16 x 128 x 2 B = 4 KiB of K and of V per program


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, H_kv, D], any strides
    value_ptr,  # [T, H_kv, D], any strides
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64, -1 = skip
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1)  # [BLOCK_T] int64
    # Padding tokens (e.g. CUDA-graph filler) carry slot -1 and must not touch the cache.
    ok = slot >= 0
    d = tl.arange(0, D_PAD)
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)
    k = tl.load(
        key_ptr + tok64[:, None] * stride_kt + head * stride_kh + d[None, :] * stride_kd, mask=mask
    )  # [BLOCK_T, D_PAD]
    v = tl.load(value_ptr + tok64[:, None] * stride_vt + head * stride_vh + d[None, :] * stride_vd, mask=mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch
    dst = dst[:, None] + d[None, :]  # [BLOCK_T, D_PAD]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, H_kv, D], any strides
    value: torch.Tensor,  # [T, H_kv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * block_size + offset; -1 = skip
    block_t: int = BLOCK_T,
) -> None:
    """Scatter this step's new keys and values into their cache slots."""
    t, n_kv, d = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (n_kv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: key {tuple(key.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head dim")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if t == 0:
        return
    grid = (triton.cdiv(t, block_t), n_kv)
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        t,
        k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
        BLOCK_T=block_t,
        num_warps=4 if d > 64 else 2,
    )

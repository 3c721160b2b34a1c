"""The lean decoder's element-wise steps fused for the GPU (Triton twins of kernels/pytorch/fused.py):
residual add + RMSNorm, SiLU(gate) * up, and rotary embedding + K/V store. Unfused, each is 3-8
PyTorch ops per layer, one launch and one pass over memory each; unfused, the GPU engine is
host-bound (docs/performance-log.md#gpu-performance-one-h200-2026-12-04).

Same arithmetic as the PyTorch twins, rounding to the tensor dtype wherever an unfused op stores a
tensor, statistics in fp32:
  - add_rms_norm: x + delta stored as the add stores it (bit for bit); the norm's mean sums in
    another order and takes the GPU's rsqrt, so the normalised value may differ in the last bit.
  - silu_mul: gate / (1 + exp(-gate)) (IEEE division), rounded, times up: exp is Triton's, a few
    fp32 ulp from PyTorch's, which the rounding to fp16/bf16 almost always hides.
  - rope_store_kv: products and sum kept apart (launched with fp fusion off, so no FMA), each
    rounded: bit for bit the PyTorch twin in every dtype; k and v stored as store_kv stores them.

Shapes (gpt-fast style): T tokens, hidden the model width, I the MLP's intermediate size, H / H_kv
query / KV heads, D head dim, cache [num_blocks, block_size, H_kv, D]. Inputs are rows with unit
column stride (any row stride); outputs are new contiguous tensors.

Grids: add_rms_norm one program per row (the row's sum of squares stays in registers), BLOCK the
next power of two >= hidden; silu_mul (T, cdiv(I, BLOCK)), no statistic ties a row together, so a
decode step's few rows still fill several programs; rope_store_kv one program per token, all its
q and k heads as one [next_pow2(H + H_kv), next_pow2(D)] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 2048  # columns per silu_mul program at most: 2 x 2048 x 2 B = 8 KiB read per program


def _num_warps(elements: int) -> int:
    """Warps for a program that touches `elements` values once: 4 up to 1k, 8 up to 4k, then 16."""
    return 4 if elements <= 1024 else 8 if elements <= 4096 else 16


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, hidden]
    delta_ptr,  # [T, hidden]; not read without HAS_DELTA
    weight_ptr,  # [hidden]
    sum_ptr,  # [T, hidden] out: x + delta; not written without HAS_DELTA
    out_ptr,  # [T, hidden] out: rms_norm(x + delta)
    hidden,
    eps,
    stride_x,
    stride_delta,
    stride_sum,
    stride_out,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_DELTA:
        s = (x + tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=ok)  # rounded as the unfused add stores it
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / hidden  # padding columns are 0
    y = (x * tl.math.rsqrt(mean_sq + eps)).to(dtype)  # the normalised value rounded before the weight
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 I]: gate columns first, then up
    out_ptr,  # [T, I]
    inter,  # I
    stride_g,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < inter
    dtype = out_ptr.dtype.element_ty
    src = gate_up_ptr + row * stride_g + cols
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=ok, other=0.0).to(tl.float32)
    a = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype)  # F.silu's formula and its output tensor
    tl.store(out_ptr + row * stride_o + cols, (a.to(tl.float32) * u).to(dtype), mask=ok)


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr,  # [T, (H + 2 H_kv) D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D], rotate_half's sign folded in
    q_ptr,  # [T, H, D] out, contiguous
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64, -1 = not stored
    num_heads,
    num_kv_heads,
    block_size,
    stride_t,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next_pow2(H + H_kv)
    KV_PAD: tl.constexpr,  # next_pow2(H_kv)
):
    tok = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM  # head dims 80 and 96 are padded to 128
    partner = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(u, D/2)[d] == u[(d + D/2) % D]
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]: q heads, then k heads
    qk_ok = (heads < num_heads + num_kv_heads)[:, None] & d_ok[None, :]  # [HEADS_PAD, D_PAD]
    row = qkv_ptr + tok * stride_t
    x = tl.load(row + heads[:, None] * HEAD_DIM + d[None, :], mask=qk_ok, other=0.0).to(tl.float32)
    xr = tl.load(row + heads[:, None] * HEAD_DIM + partner[None, :], mask=qk_ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + tok * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)  # [D_PAD]
    s = tl.load(sin_ptr + tok * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    # qk * cos + roll(qk) * sin, each product and the sum rounded as the unfused ops store them.
    r = ((x * c[None, :]).to(dtype).to(tl.float32) + (xr * s[None, :]).to(dtype).to(tl.float32)).to(dtype)

    is_q = heads < num_heads
    q_dst = q_ptr + tok * num_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(q_dst, r, mask=qk_ok & is_q[:, None])

    slot = tl.load(slot_mapping_ptr + tok)  # int64
    # Padding tokens (e.g. CUDA-graph filler) carry slot -1 and must not touch the cache. The
    # test is made per head (a block, not a scalar): the interpreter turns `bool block & bool
    # scalar` into an int32 mask, which its store rejects.
    k_ok = (heads >= num_heads) & ((tl.zeros([HEADS_PAD], tl.int64) + slot) >= 0)  # [HEADS_PAD]
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    k_dst = k_cache_ptr + dst + (heads - num_heads)[:, None] * stride_ch + d[None, :]
    tl.store(k_dst, r.to(k_cache_ptr.dtype.element_ty), mask=qk_ok & k_ok[:, None])
    kv = tl.arange(0, KV_PAD)
    v_ok = ((kv < num_kv_heads) & ((tl.zeros([KV_PAD], tl.int64) + slot) >= 0))[:, None] & d_ok[None, :]
    v_src = row + (num_heads + num_kv_heads) * HEAD_DIM + kv[:, None] * HEAD_DIM + d[None, :]
    v = tl.load(v_src, mask=v_ok, other=0.0)
    tl.store(v_cache_ptr + dst + kv[:, None] * stride_ch + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as rows with unit column stride (a copy only where it has none)."""
    if t.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    delta: torch.Tensor | None,  # [T, hidden]; None adds nothing
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm; without delta
    (x, rms_norm(x)), x itself returned."""
    x = _rows(x, "x")
    t, hidden = x.shape
    if delta is not None:
        delta = _rows(delta, "delta")
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} != x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError(f"weight must be [{hidden}] {x.dtype} with unit stride, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    if t == 0:
        return total, out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(t,)](
        x,
        delta if delta is not None else x,
        weight,
        total,
        out,
        hidden,
        eps,
        x.stride(0),
        delta.stride(0) if delta is not None else 0,
        total.stride(0),
        out.stride(0),
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return total, out


def silu_mul(gate_up: torch.Tensor, block: int = SILU_BLOCK) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:], as the fused gate/up projection leaves them."""
    gate_up = _rows(gate_up, "gate_up")
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up width {width} is odd")
    inter = width // 2
    out = gate_up.new_empty((t, inter))
    if t == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), block)
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=_num_warps(block)
    )
    return out


def rope_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 H_kv) D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D], rotate_half's sign folded in: [-sin[:, :D/2], sin[:, D/2:]]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, -1 = not stored
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [T, H, D]
    """Rotary embedding of q and k (the decoder's roll form), rotated k and v written into the
    paged caches at `slots`; returns the rotated q."""
    qkv, cos, sin = _rows(qkv, "qkv"), _rows(cos, "cos"), _rows(sin, "sin")
    t, width = qkv.shape
    h, hk, d = num_heads, num_kv_heads, cos.shape[1]
    if d % 2 or width != (h + 2 * hk) * d or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} for H={h}, H_kv={hk}")
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"cos/sin must be {qkv.dtype}, got {cos.dtype}/{sin.dtype}")
    if k_cache.shape[2:] != (hk, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} for H_kv={hk}, D={d}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head dim")
    if slots.dtype != torch.int64 or slots.shape != (t,):
        raise ValueError(f"slots must be [{t}] int64, got {tuple(slots.shape)} {slots.dtype}")
    q = qkv.new_empty((t, h, d))
    if t == 0:
        return q
    d_pad, heads_pad = triton.next_power_of_2(d), triton.next_power_of_2(h + hk)
    _rope_store_kv_kernel[(t,)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slots,
        h,
        hk,
        k_cache.shape[1],
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=d,
        D_PAD=d_pad,
        HEADS_PAD=heads_pad,
        KV_PAD=triton.next_power_of_2(hk),
        num_warps=_num_warps(heads_pad * d_pad),
        enable_fp_fusion=False,  # products and sum rounded apart, as the unfused ops do
    )
    return q

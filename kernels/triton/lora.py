"""The segmented LoRA update on the GPU: the Triton twins of the dispatch table's `lora_sgmv` and
`lora_batched` (kernels/pytorch/lora.py, same signatures; docs/lora.md "The Triton kernels").

A step's rows that use an adapter are listed grouped by segment (one segment per adapter slot
present), `order` their row indices, `starts` each segment's first position in `order`. Two
launches cover every adapter of the step:

- the shrink: a program takes BLOCK_M rows of one segment, loads them by index, and sums
  x[rows] @ A_slot^T over `in` in BLOCK_K steps into a fp32 [BLOCK_M, R] tile, stored in the
  [N, R] fp32 intermediate `h` at the rows' positions in `order`;
- the expand: a program takes the same rows and BLOCK_N output columns, one tl.dot of h (rounded
  to y's dtype first in fp16/bf16, as PEFT's lora_A output is) against B_slot^T, then PEFT's
  roundings (the expand and the scale each rounded to y's dtype, then y plus that) and the store
  into y's columns (y may be a column slice of a fused output: its row stride is passed).

Rows of no segment (the base model's, pad rows) are not read and not written. The weights are
the stacks `lora_batched` reads (A [S R, in], B [out, S R], any strides: the resident stacks keep
B over B^T's storage), or, for `lora_sgmv`, its groups' own A and B (several adapters zero-padded
into a stack of their own). fp32 dots run as "ieee" (no TF32). The sums' order is tl.dot's, not
the GEMMs': the result is the twin's within fp32 accumulation (tests/kernels/test_triton_lora.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, Part

BLOCK_M, BLOCK_K, BLOCK_N = 16, 32, 64  # tl.dot's sides: multiples of 16 (BLOCK_K 64 spilled at rank 64, sm_90)
NUM_WARPS = 4


def rank_pad(rank: int) -> int:
    """The rank as the kernels tile it: a power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def _segment(order_ptr, starts_ptr, slot_ptr, g, BLOCK_M: tl.constexpr):
    """Segment g's first position in `order`, its row count, and this program's BLOCK_M of its
    rows: their positions within it, which are live, their row indices, the segment's slot."""
    first = tl.load(starts_ptr + g)
    count = tl.load(starts_ptr + g + 1) - first
    pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = pos < count
    rows = tl.load(order_ptr + first + pos, mask=live, other=0).to(tl.int64)
    return first, count, pos, live, rows, tl.load(slot_ptr + g).to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, in], row stride stride_xm, unit column stride
    a_ptr,  # the stacked A: slot s's rank j at a_ptr + (s R + j) stride_ar + k stride_ak
    h_ptr,  # [N, R_PAD] fp32, contiguous: row i is order[i]'s shrink
    order_ptr,  # [N] int32: the rows, segment by segment
    starts_ptr,  # [G + 1] int32: segment g is order[starts[g]:starts[g + 1]]
    slot_ptr,  # [G] int32: segment g's slot in the stacks
    K,
    R,
    stride_xm,
    stride_ar,
    stride_ak,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr,
):
    first, count, pos, live, rows, slot = _segment(order_ptr, starts_ptr, slot_ptr, tl.program_id(1), BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:  # past the segment's rows
        return
    ranks = tl.arange(0, R_PAD)
    a_rows = (slot * R + ranks).to(tl.int64) * stride_ar  # [R_PAD]
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
        a_mask = (ks[:, None] < K) & (ranks[None, :] < R)
        a = tl.load(a_ptr + a_rows[None, :] + ks[:, None].to(tl.int64) * stride_ak, mask=a_mask, other=0.0)
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    h_at = (first + pos).to(tl.int64)[:, None] * R_PAD + ranks[None, :]
    tl.store(h_ptr + h_at, acc, mask=live[:, None])


@triton.jit
def _expand_kernel(
    h_ptr,  # [N, R_PAD] fp32, the shrink's
    b_ptr,  # the stacked B: output n, slot s's rank j at b_ptr + n stride_bn + (s R + j) stride_br
    y_ptr,  # [T, out], row stride stride_ym, unit column stride; updated in place
    scale_ptr,  # [G] fp32: segment g's adapter scale
    order_ptr,  # the shrink's segments
    starts_ptr,
    slot_ptr,
    stride_bn,
    stride_br,
    stride_ym,
    N_OUT,
    R,
    IEEE: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(2)
    first, count, pos, live, rows, slot = _segment(order_ptr, starts_ptr, slot_ptr, g, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= count:  # past the segment's rows
        return
    scale = tl.load(scale_ptr + g)
    ranks = tl.arange(0, R_PAD)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + (first + pos).to(tl.int64)[:, None] * R_PAD + ranks[None, :], mask=live[:, None], other=0.0)
    b_mask = (ranks[:, None] < R) & (cols[None, :] < N_OUT)
    b_at = (slot * R + ranks).to(tl.int64)[:, None] * stride_br + cols[None, :].to(tl.int64) * stride_bn
    b = tl.load(b_ptr + b_at, mask=b_mask, other=0.0)  # [R_PAD, BLOCK_N]: B^T's tile
    y_at = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_mask = live[:, None] & (cols[None, :] < N_OUT)
    y = tl.load(y_at, mask=y_mask, other=0.0)
    if IEEE:  # fp32: the expand, times the scale, plus y: the twin's two roundings
        d = tl.dot(h, b, input_precision="ieee")
        tl.store(y_at, y + d * scale, mask=y_mask)
    else:  # PEFT's: h, the expand and the scaled expand each rounded to y's dtype, then y + that
        d = tl.dot(h.to(b.dtype), b).to(b.dtype)
        delta = (d.to(tl.float32) * scale).to(b.dtype)
        tl.store(y_at, (y.to(tl.float32) + delta.to(tl.float32)).to(b.dtype), mask=y_mask)


@dataclass(frozen=True)
class Segments:
    """A step's rows by segment, on the device: `order` [N] int32 the rows, segment by segment,
    `starts` [G + 1] int32, `slots` [G] int32 each segment's slot, `scale` [G] fp32 its adapter's
    scale; `count` G and `longest` the most rows of a segment (the grid's first side)."""

    order: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    scale: torch.Tensor
    count: int
    longest: int

    @classmethod
    def of(cls, groups: Sequence[tuple[torch.Tensor, int, float]], device: torch.device | str) -> Segments | None:
        """From (rows, slot, scale) per segment, its empty ones dropped; None when no row is left."""
        groups = [g for g in groups if g[0].numel()]
        if not groups:
            return None
        counts = [int(rows.numel()) for rows, _, _ in groups]
        starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        order = torch.cat([rows.cpu().to(torch.int32) for rows, _, _ in groups])
        slots = torch.tensor([slot for _, slot, _ in groups], dtype=torch.int32)
        scale = torch.tensor([sc for _, _, sc in groups], dtype=torch.float32)
        order, starts, slots, scale = (t.to(device) for t in (order, starts, slots, scale))
        return cls(order, starts, slots, scale, len(groups), max(counts))


@functools.lru_cache(maxsize=8)
def _batch_segments(slot_of: tuple[int, ...], scales: tuple[float, ...], device: str) -> Segments | None:
    """A step's segments for `lora_batched`: built once per step (its batch), not once per call."""
    rows = torch.tensor(slot_of, dtype=torch.int64)
    present = sorted({s for s in slot_of if s >= 0})
    return Segments.of([(torch.nonzero(rows == s).flatten(), s, scales[s]) for s in present], device)


def segmented_update(
    y: torch.Tensor,
    x: torch.Tensor,
    seg: Segments | None,
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
    h: torch.Tensor | None = None,
) -> None:
    """y[rows] += (x[rows] @ A_s^T) @ B_s^T * scale for each segment (rows, slot s, scale) of
    `seg`, A_s rows s R..s R + R - 1 of `a` [S R, in] and B_s those columns of `b` [out, S R]; two
    launches (none without rows). `h`: the shrink's [N, R_PAD] fp32 intermediate, given or made."""
    if seg is None or y.shape[1] == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("the LoRA kernels write y's columns at unit stride")
    r_pad = rank_pad(rank)
    if h is None:
        h = torch.empty((seg.order.numel(), r_pad), dtype=torch.float32, device=y.device)
    ieee = y.dtype == torch.float32
    m_blocks = triton.cdiv(seg.longest, BLOCK_M)
    _shrink_kernel[(m_blocks, seg.count)](
        x, a, h, seg.order, seg.starts, seg.slots, x.shape[1], rank, x.stride(0), a.stride(0), a.stride(1),
        ieee, BLOCK_M, BLOCK_K, r_pad, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    n_out = y.shape[1]
    _expand_kernel[(m_blocks, triton.cdiv(n_out, BLOCK_N), seg.count)](
        h, b, y, seg.scale, seg.order, seg.starts, seg.slots, b.stride(0), b.stride(1), y.stride(0), n_out, rank,
        ieee, r_pad, BLOCK_M, BLOCK_N, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


def _rows(rows: slice | torch.Tensor) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows.cpu()


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
    """kernels/pytorch/lora.py's `lora_sgmv` in two launches: the groups of one adapter (one `A`
    tensor) share a slot; several adapters are zero-padded into a stack of their own ranks' max."""
    if not groups:
        return
    slots: dict[int, int] = {}
    adapters: list[LoraGroup] = []
    for g in groups:
        if id(g.a) not in slots:
            slots[id(g.a)] = len(adapters)
            adapters.append(g)
    seg = Segments.of([(_rows(g.rows), slots[id(g.a)], g.scale) for g in groups], y.device)
    if len(adapters) == 1:
        a, b = adapters[0].a, adapters[0].b
        segmented_update(y, x, seg, a, b, a.shape[0])
        return
    rank = max(g.a.shape[0] for g in adapters)
    a = torch.zeros((len(adapters), rank, x.shape[1]), dtype=y.dtype, device=y.device)
    b = torch.zeros((len(adapters), rank, y.shape[1]), dtype=y.dtype, device=y.device)
    for s, g in enumerate(adapters):
        a[s, : g.a.shape[0]] = g.a
        b[s, : g.a.shape[0]] = g.b.t()
    segmented_update(y, x, seg, a.view(-1, x.shape[1]), b.view(-1, y.shape[1]).t(), rank)


def lora_batched(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, a: torch.Tensor, b: torch.Tensor) -> None:
    """kernels/pytorch/lora.py's `lora_batched` in two launches: one segment per slot present,
    each row against its own slot's R columns of the stacks (no mask, no gather)."""
    seg = _batch_segments(batch.slot_of, batch.scales, str(y.device))
    segmented_update(y, x, seg, a, b, batch.rank)


def lora_batched_parts(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, parts: Sequence[Part]) -> None:
    """`lora_batched` for each projection of a fused output (kernels/pytorch/lora.py's)."""
    for first, last, a, b in parts:
        lora_batched(y[:, first:last], x, batch, a, b)

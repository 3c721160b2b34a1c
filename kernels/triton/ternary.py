"""BitNet's ternary GEMM on the GPU: int8 activations times weights in {-1, 0, +1} packed four to a
byte, int32 sums (the Triton twin of kernels/ternary.py's `torch._int_mm`; docs/bitnet.md "The
kernel").

Layout: `pack_ternary` keeps 2 bits a weight, the code w + 1 in {0, 1, 2}, four consecutive output
columns in one byte: byte [n // 4, k] holds column n's code in bits 2 (n % 4)..2 (n % 4) + 1. A
program computes a [BLOCK_M, BLOCK_N] tile of the int32 sums: per BLOCK_K step it loads the
activations' [BLOCK_M, BLOCK_K] int8 tile and the weights' [BLOCK_K, BLOCK_N] codes (each byte read
by its four columns, from the cache after the first), unpacks them to int8 values in registers and
takes one int8 `tl.dot` into the int32 accumulator. Integer sums are exact in any order, so the
output equals the twin's bit for bit on every tiling (tests/kernels/test_triton_ternary.py, under
the interpreter; compiled for sm_80 and sm_90 by compile_check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # tl.dot's int8 tiles: every side a multiple of 16


@triton.jit
def _ternary_kernel(
    x_ptr,  # [M, K] int8, row stride stride_xm
    w_ptr,  # [ceil(N / 4), K] uint8: four columns' codes a byte
    out_ptr,  # [M, N] int32, row stride stride_om
    M,
    N,
    K,
    stride_xm,
    stride_wr,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    shift = (cols % 4) * 2  # [BLOCK_N]: the column's bits in its byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x_mask = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=x_mask, other=0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < N)
        # Code 1 (the value 0) outside the weight: padded columns and depths add nothing.
        b = tl.load(w_ptr + (cols[None, :] // 4).to(tl.int64) * stride_wr + ks[:, None], mask=w_mask, other=85)
        w = (((b.to(tl.int32) >> shift[None, :]) & 3) - 1).to(tl.int8)  # [BLOCK_K, BLOCK_N] in {-1, 0, 1}
        acc += tl.dot(x, w, out_dtype=tl.int32)
    o_mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc, mask=o_mask)


def pack_ternary(weight: torch.Tensor) -> torch.Tensor:  # [N, K] int8 in {-1, 0, 1} -> [ceil(N/4), K] uint8
    """The kernel's layout of a ternary weight (four consecutive output columns a byte)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"a ternary weight is a 2-D int8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    if bool(((weight < -1) | (weight > 1)).any()):
        raise ValueError("a ternary weight holds a value outside {-1, 0, 1}")
    n, k = weight.shape
    codes = torch.ones((-(-n // 4) * 4, k), dtype=torch.uint8, device=weight.device)  # code 1: the value 0
    codes[:n] = (weight + 1).to(torch.uint8)
    codes = codes.view(-1, 4, k)  # [N/4, 4, K]
    return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)).contiguous()


def ternary_int_mm(x_q: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:  # [M, K] int8 -> [M, N] int32
    """x_q @ w.T in int32, w the [n, K] ternary weight `pack_ternary` packed."""
    m, k = x_q.shape
    if x_q.dtype != torch.int8 or packed.dtype != torch.uint8 or packed.shape != (-(-n // 4), k):
        raise ValueError(f"int8 [M, K] against packed [ceil(N/4), K] uint8, got {x_q.dtype} {tuple(x_q.shape)}")
    out = torch.empty((m, n), dtype=torch.int32, device=x_q.device)
    if m == 0:
        return out
    x_q = x_q if x_q.stride(1) == 1 else x_q.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _ternary_kernel[grid](
        x_q, packed, out, m, n, k, x_q.stride(0), packed.stride(0), out.stride(0), BLOCK_M, BLOCK_N, BLOCK_K
    )
    return out

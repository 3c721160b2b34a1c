"""The PyTorch twin of the int8-activation GEMM (docs/int8-activations.md, "Exactness"): the oracle
the C++ kernels (`kernels/cpu/csrc/gemm/gemm_int8.cpp`) equal bit for bit, and the fallback where
they are not built.

Activations: each row quantized per block of 32, d = max|x| / 127 (IEEE division), codes
round-to-nearest-even(x * (1 / d)) clamped to [-127, 127] (0 where d is 0). Weights: the block codes
as served (`kernels/quant.py`), q4_k as q4_1-like 32-blocks with fp32 scale and min, q6_k as 8-bit
codes with a scale per 16. Each block's dot product of codes is an integer below 2^20 in magnitude,
exact in any fp32 summation order (bmm here, int32 lanes there). The blocks are then summed in one
fixed order, per output element:

    acc = 0
    for each block b, for each span s of it (q6_k: 2 of 16 k, else 1 of 32):
        acc = acc + (sw[n, b, s] * sa[m, b]) * isum[m, n, b, s]
        (formats with a min, after the spans) acc = acc + mw[n, b] * (sa[m, b] * sum_k qa[m, b, k])
    y = acc + bias   (bf16 x: rounded once to bf16)

every operation an fp32 rounding of its own (no fused multiply-add), as torch's element-wise ops do.
"""

from __future__ import annotations

import torch

GROUP = 32
_ROWS = 64  # rows per chunk: bounds the [blocks, rows, N] integer sums held at once


def quantize_rows(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, K] fp32/bf16 -> (codes int8 [M, K], scales fp32 [M, K / 32], code sums int32 [M, K / 16]).
    pow2: the scale a power of two, 2^e, instead (a variant `orcaserve-bench quality` measures; the C++
    kernels do not run it: docs/int8-activations.md, "A power-of-two activation scale")."""
    m, k = x.shape
    xb = x.float().reshape(m, k // GROUP, GROUP)
    amax = xb.abs().amax(-1)
    d = torch.div(amax, torch.full_like(amax, 127.0))  # a tensor divisor: a true IEEE division
    if pow2:
        d, inv = pow2_scale(d)
    else:
        safe = torch.where(d == 0, torch.ones_like(d), d)
        inv = torch.where(d == 0, torch.zeros_like(d), torch.div(torch.ones_like(d), safe))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)
    sums = q.reshape(m, k // 16, 16).sum(-1).to(torch.int32)  # exact: integers below 2^11
    return q.to(torch.int8).reshape(m, k), d, sums


E_MIN, E_MAX = -100, 100  # the power-of-two scale's exponent range


def pow2_scale(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d = max|x| / 127 fp32 [...] -> (2^e, 2^-e) with e = ceil(log2(d)) read off d's bits (exponent,
    plus one where the mantissa is not 0), clamped to [E_MIN, E_MAX] (d = 0 gives E_MIN)."""
    bits = d.view(torch.int32)
    e = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e = e.clamp(E_MIN, E_MAX)
    return ((e + 127) << 23).view(torch.float32), ((127 - e) << 23).view(torch.float32)


def block_sums(qa: torch.Tensor, qw: torch.Tensor, span: int) -> torch.Tensor:
    """Integer dot products per span of `span` k: qa int8 [M, K], qw int8 [N, K] -> fp32 [K / span,
    M, N], exact (every partial sum an integer below 2^24)."""
    m, k = qa.shape
    n = qw.shape[0]
    a = qa.float().reshape(m, k // span, span).transpose(0, 1)  # [S, M, span]
    w = qw.float().reshape(n, k // span, span).permute(1, 2, 0)  # [S, span, N]
    return torch.bmm(a, w)


def linear_int8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    pow2: bool = False,
) -> torch.Tensor:
    """y = x W^T (+ b) in the fixed order above: x [M, K] fp32/bf16; W's codes q int8 [N, K], scale
    fp32 [N, K / span] (span 32, or 16 for q6_k), offset fp32 [N, K / 32] or None. -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    per_block = scale.shape[1] // (k // GROUP)  # spans per block: 2 for q6_k
    span = GROUP // per_block
    qa, sa, sums = quantize_rows(x, pow2)
    msum = sa * sums.reshape(m, k // GROUP, 2).sum(-1).float()  # [M, K / 32]
    out = torch.empty(m, n, dtype=torch.float32)
    sw = scale.t().contiguous()  # [K / span, N]
    mw = None if offset is None else offset.t().contiguous()  # [K / 32, N]
    for r in range(0, m, _ROWS):
        isum = block_sums(qa[r : r + _ROWS], q, span)  # [K / span, rows, N]
        sa_r, ms_r = sa[r : r + _ROWS], msum[r : r + _ROWS]
        acc = torch.zeros(isum.shape[1], n, dtype=torch.float32)
        for b in range(k // GROUP):
            for s in range(per_block):
                i = b * per_block + s
                acc = acc + (sw[i].unsqueeze(0) * sa_r[:, b : b + 1]) * isum[i]
            if mw is not None:
                acc = acc + mw[b].unsqueeze(0) * ms_r[:, b : b + 1]
        out[r : r + _ROWS] = acc
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

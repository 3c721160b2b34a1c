"""The lean decoder's element-wise steps as separate PyTorch ops: the oracles of the fused kernels
(the C++ operators in kernels/cpu/csrc/fused/ and the Triton ones in kernels/triton/fused.py) and
what the decoder runs where neither is used. Each is transformers' arithmetic op for op, rounding
to the tensor dtype where transformers' ops store a tensor.

Shapes (gpt-fast style):
    T        tokens of the step
    hidden   model width; I the MLP's intermediate size
    H, H_kv  query heads, key/value heads; D head dim
    cache    [num_blocks, block_size, H_kv, D]

`add_rms_norm`, `silu_mul` and `rope_store_kv` have the positional signatures of their Triton
versions in `orcaserve.kernels.triton.fused`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orcaserve.kernels.pytorch.attention import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op (fp32 statistics, weight applied in the input dtype)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    delta: torch.Tensor | None,  # [T, hidden]; None adds nothing
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """silu(gate) * up of the fused gate/up projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 H_kv) D], the fused q/k/v projection
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D], rotate_half's sign folded in: [-sin[:, :D/2], sin[:, D/2:]]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, -1 = not stored
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [T, H, D], a view of a [T, H + H_kv, D] tensor
    """Rotary embedding of q and k, k and v stored at their slots; returns the rotated q.

    rotate_half(u) * sin == roll(u, D/2) * sin with the sign folded into sin (the decoder's form):
    each product and the sum rounded to the dtype, as the unfused ops store them."""
    h, hk, d = num_heads, num_kv_heads, cos.shape[-1]
    qk = qkv[:, : (h + hk) * d].view(-1, h + hk, d)  # [T, H + H_kv, D], rotated together
    qk = qk * cos[:, None, :] + qk.roll(d // 2, dims=-1) * sin[:, None, :]
    q, k = qk.split([h, hk], dim=1)  # [T, H, D], [T, H_kv, D]
    v = qkv[:, (h + hk) * d :].view(-1, hk, d)  # [T, H_kv, D]
    store_kv(k, v, k_cache, v_cache, slots)
    return q

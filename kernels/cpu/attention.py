"""The "cpu" `AttentionBackend`: paged attention through the C++ operator.

`csrc/attention/paged_attention.cpp` is `torch.ops.orcaserve.paged_attention.<variant>(q, k_cache,
v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)`, the same computation as
`kernels/pytorch/attention.unified_attention`, reading K/V blocks in place instead of gathering a
padded copy. The variant per cache dtype is `kernels/dispatch.py`'s; the library: `build.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.attention_backend import AttentionBackend
from orcaserve.kernels.cpu import build
from orcaserve.kernels.pytorch import attention as torch_attention
from orcaserve.kernels.pytorch.backend import TorchBackend

log = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the template instances in the .cpp
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_attention(
    q: torch.Tensor,  # [T, H, D], head dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], contiguous, q's dtype
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:
    """`unified_attention` through the C++ operator the dispatch table picks (which must load)."""
    ok, reason = build.load(build=True)
    op = dispatch.kernel("paged_attention", q.dtype) if ok else None
    if op is None:
        raise RuntimeError(f"orcaserve CPU attention unavailable for {q.dtype}: {reason}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    op(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q.int().contiguous(),
        seq_lens.int().contiguous(),
        block_tables.int().contiguous(),
        float(scale),
        out,
    )
    return out


@dataclass
class CpuAttentionPlan:
    """Step metadata in the operator's layout (contiguous int32, CPU), converted once per step."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    fallback: torch_attention.TorchAttentionPlan | None = None  # built only if a layer cannot use the op


class CpuBackend(AttentionBackend):
    """Paged attention through the C++ operator; K/V stored by the PyTorch `store_kv`.

    Work items are derived inside the operator (a loop over B, microseconds), so the plan is
    only the metadata in its final dtype and layout. The operator's variant is looked up once per
    cache dtype (`kernels/dispatch.py`).
    """

    name = "cpu"

    def __init__(self) -> None:
        self._ops: dict[torch.dtype, Any] = {}
        self._warned = False

    def op_for(self, dtype: torch.dtype) -> Any | None:
        """The operator for caches of `dtype`, or None where the dispatch table says torch."""
        if dtype not in self._ops:
            self._ops[dtype] = dispatch.kernel("paged_attention", dtype)
        return self._ops[dtype]

    def plan(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1]
        seq_lens: torch.Tensor,  # [B]
        block_tables: torch.Tensor,  # [B, max_blocks]
        block_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> CpuAttentionPlan:
        def prep(t: torch.Tensor) -> torch.Tensor:
            return t.to(device="cpu", dtype=torch.int32).contiguous()

        return CpuAttentionPlan(prep(cu_seqlens_q), prep(seq_lens), prep(block_tables), int(block_size))

    def store_kv(
        self,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        torch_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        plan: CpuAttentionPlan,
        q: torch.Tensor,  # [T, H, D], any strides
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D]
    ) -> torch.Tensor:
        cache_dtype = k_cache.dtype
        op = self.op_for(cache_dtype) if q.shape[-1] in SUPPORTED_HEAD_DIMS and q.device.type == "cpu" else None
        if op is None:
            return self._fallback(plan, q, k_cache, v_cache, scale, out)
        # The operator reads q and writes out through their strides; only the head dim must be dense.
        qc = q if q.dtype == cache_dtype and q.stride(-1) == 1 else q.to(cache_dtype).contiguous()
        direct = out is not None and out.dtype == cache_dtype and out.stride(-1) == 1
        res = out if out is not None and direct else torch.empty(qc.shape, dtype=cache_dtype)  # [T, H, D]
        op(qc, k_cache, v_cache, plan.cu_seqlens_q, plan.seq_lens, plan.block_tables, float(scale), res)
        if out is not None and not direct:
            return out.copy_(res)
        return res if q.dtype == cache_dtype else res.to(q.dtype)

    def _fallback(
        self,
        plan: CpuAttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Shapes the operator was not compiled for go through the PyTorch path, said once."""
        if not self._warned:
            log.warning(
                "attention_backend 'cpu': head dim %d, %s on %s not supported by the C++ operator; "
                "using the PyTorch path for it",
                q.shape[-1],
                k_cache.dtype,
                q.device,
            )
            self._warned = True
        if plan.fallback is None:
            dev = q.device
            plan.fallback = torch_attention.TorchAttentionPlan(
                plan.cu_seqlens_q.to(dev), plan.seq_lens.to(dev), plan.block_tables.to(dev), plan.block_size
            )
        return plan.fallback.attend(q, k_cache, v_cache, scale, out)


def make_cpu_backend(build_missing: bool = True) -> AttentionBackend:
    """`CpuBackend` if the library loads, else `TorchBackend` after one warning saying why."""
    ok, reason = build.load(build=build_missing)
    if not ok:
        log.warning("attention_backend 'cpu': C++ operator unavailable, using the PyTorch path (%s)", reason)
        return TorchBackend()
    return CpuBackend()

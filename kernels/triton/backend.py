"""`AttentionBackend` on the Triton kernels (CUDA; runs on CPU tensors only under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orcaserve.kernels.attention_backend import AttentionBackend
from orcaserve.kernels.triton.attention import choose_num_splits, num_sms, unified_attention
from orcaserve.kernels.triton.store_kv import store_kv


@dataclass
class TritonAttentionPlan:
    """Step metadata shared by every layer; nothing here needs a host sync."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    # The split decision needs H_kv and G, which only the first `attend` sees; every layer of a
    # model has the same shapes, so it is made once and reused.
    num_splits: int | None = None


class TritonBackend(AttentionBackend):
    name = "triton"

    def plan(self, cu_seqlens_q, seq_lens, block_tables, block_size, max_seqlen_q, max_seqlen_k):
        return TritonAttentionPlan(
            cu_seqlens_q=cu_seqlens_q.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables.to(torch.int32),
            block_size=int(block_size),
            max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k),
        )

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, plan: TritonAttentionPlan, q, k_cache, v_cache, scale, out=None):
        if plan.num_splits is None:
            n_kv = k_cache.shape[2]
            plan.num_splits = choose_num_splits(
                q.shape[0],
                plan.seq_lens.shape[0],
                n_kv,
                q.shape[1] // n_kv,
                plan.max_seqlen_q,
                plan.max_seqlen_k,
                num_sms(q.device),
                q.dtype,
                head_dim=q.shape[2],
            )
        return unified_attention(
            q,
            k_cache,
            v_cache,
            plan.cu_seqlens_q,
            plan.seq_lens,
            plan.block_tables,
            scale,
            out,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            num_splits=plan.num_splits,
        )

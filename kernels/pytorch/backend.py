"""The PyTorch twins as an attention backend: the CPU default, and the oracle the others match."""

from __future__ import annotations

import torch

from orcaserve.kernels.attention_backend import AttentionBackend
from orcaserve.kernels.pytorch import attention as torch_attention


class TorchBackend(AttentionBackend):
    """PyTorch twins: the CPU default."""

    name = "torch"

    def plan(self, cu_seqlens_q, seq_lens, block_tables, block_size, max_seqlen_q, max_seqlen_k):
        return torch_attention.TorchAttentionPlan(cu_seqlens_q, seq_lens, block_tables, block_size)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        torch_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, plan, q, k_cache, v_cache, scale, out=None) -> torch.Tensor:
        return plan.attend(q, k_cache, v_cache, scale, out)

"""The contract between the model runner and an attention implementation: the backends
(kernels/pytorch/backend.py, kernels/cpu/attention.py, kernels/triton/backend.py) implement it,
kernels/backends.py picks one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class AttentionBackend(ABC):
    """Stores a step's K/V into the paged cache and attends through block tables.

    The runner calls `plan` once per step with the step's metadata and then, for every layer,
    `store_kv` followed by `attend` with that plan. A plan holds whatever a backend can derive
    once per step (gather indices, masks, a split-K decision) so the per-layer calls stay cheap.
    """

    name: str

    @abstractmethod
    def plan(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        seq_lens: torch.Tensor,  # [B] int32, cached + new tokens
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        block_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> Any:
        """Per-step layout shared by every layer."""

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Write the step's new keys and values into their slots."""

    @abstractmethod
    def attend(
        self,
        plan: Any,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of each request's new queries over its whole cached context."""

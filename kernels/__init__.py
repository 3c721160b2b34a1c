"""Attention kernels for the merged (prefill + decode) step: PyTorch twins and Triton kernels."""

from .backend import AttentionBackend, TorchBackend, get_backend
from .torch_attention import TorchAttentionPlan, store_kv, unified_attention

__all__ = [
    "AttentionBackend",
    "TorchAttentionPlan",
    "TorchBackend",
    "get_backend",
    "store_kv",
    "unified_attention",
]

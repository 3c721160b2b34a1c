"""Triton kernels (GPU; on a CPU only under TRITON_INTERPRET=1). Importing this package does not
import Triton: each module does, and `fused_ops` says whether the decoder runs the fused ones."""

from __future__ import annotations

from types import ModuleType


def fused_ops(wanted: bool | None, cuda: bool) -> ModuleType | None:
    """kernels/triton/fused.py where the decoder runs it: by default on CUDA, where Triton imports;
    `wanted` True or False overrides (True on a CPU model needs TRITON_INTERPRET=1)."""
    if wanted is False or (wanted is None and not cuda):
        return None
    try:
        from orcaserve.kernels.triton import fused
    except ImportError:
        if wanted:
            raise
        return None
    return fused

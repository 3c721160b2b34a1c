"""The segmented LoRA update in PyTorch: the oracle and the fallback of the dispatch table's
`lora_sgmv` op (kernels/dispatch.py; docs/lora.md "The segmented update").

A step's rows are packed over many requests; each request names at most one adapter. The rows of
one adapter form a group (a contiguous run, or the rows gathered by index), and each group adds
its adapter's low-rank update to the projection's output, in place:

    y[rows] += (x[rows] @ A^T) @ B^T * scale

computed as PEFT computes it (`lora_B(lora_A(x)) * scaling`, two bias-free linears then the
scale), so an adapter's answer here is PEFT's. Rows of no group (the base model's requests, pad
rows) are not touched: they pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraGroup:
    """The rows of a step that use one adapter, and that adapter's weights for one projection."""

    rows: slice | torch.Tensor  # a contiguous run, or [N] int64 row indices
    a: torch.Tensor  # [r, in]: PEFT's lora_A.weight
    b: torch.Tensor  # [out, r]: PEFT's lora_B.weight
    scale: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
    """Add each group's update to `y` [T, out] (a view: a column slice of a fused projection's
    output is fine) from `x` [T, in], in place. One GEMM pair per group."""
    for g in groups:
        if isinstance(g.rows, slice):
            delta = F.linear(F.linear(x[g.rows], g.a), g.b) * g.scale  # [N, out]
            y[g.rows] += delta
        else:
            delta = F.linear(F.linear(x.index_select(0, g.rows), g.a), g.b) * g.scale  # [N, out]
            y.index_add_(0, g.rows, delta)

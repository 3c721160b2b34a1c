"""The lean decoder's rotary tables (cos, and sin with rotate_half's sign folded in), per step.

The model's own `rotary_emb` computes them from the step's positions: for a one-row step about ten
small ops (a product, a cat, cos, sin, two scalings, two casts, the sign fold), serial work that a
second thread does not split (docs/one-stream.md, "At one row on the Zen 5: what the roof does not
explain"). Where its frequencies are
fixed at load (the rope types of `STATIC`), a position's rows are a function of the position alone,
so `RopeTable` computes them once, by the same code on chunks of positions, and a step reads its
rows with one `index_select` each.

Bit for bit the module's: each element is the same product, then the same vector cos/sin (ATen's
Sleef loop) where a step's call runs its vector loop, the same scaling and the same cast. A call
runs the vector loop on every element where its T x D elements are a multiple of two vectors (D a
multiple of 32) and below ATen's parallel grain (one thread, no split into chunks with scalar
tails): the table applies to such steps, and is built in chunks of that size.
"""

from __future__ import annotations

from typing import Any

import torch

# Rope types whose inverse frequencies do not depend on the step (transformers' `dynamic_rope_update`
# recomputes them for the dynamic and longrope types).
STATIC = ("default", "linear", "llama3", "yarn")
GRAIN = 32768  # ATen's parallel grain (at::internal::GRAIN_SIZE): an element-wise op below it runs serially
VECTOR = 32  # elements a unary op's vector loop takes at once (two AVX-512 fp32 vectors; AVX2's 16 divide it)


def rotary_rows(rotary: Any, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, D] each for `positions` [T], in `like`'s dtype: the module's own output, sin
    with rotate_half's sign folded in: rotate_half(u) * sin == roll(u, D/2) * [-sin_lo, sin_hi]
    (one roll instead of two slices, a negation and a cat, bit for bit the same)."""
    cos, sin = rotary(like, positions[None])  # [1, T, D] each
    half = sin.shape[-1] // 2
    return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


class RopeTable:
    """`rotary_rows` by position, for steps of up to `max_rows` tokens (the module docstring)."""

    def __init__(self, rotary: Any, head_dim: int, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.like = torch.empty(0, dtype=dtype)
        self.max_rows = GRAIN // head_dim - 1
        self.cos = torch.empty(0, head_dim, dtype=dtype)  # [positions, D]
        self.sin = torch.empty(0, head_dim, dtype=dtype)

    @staticmethod
    def of(rotary: Any, head_dim: int, dtype: torch.dtype, device: torch.device) -> RopeTable | None:
        """A table where it is the module's output bit for bit: on the CPU, a rope type of
        `STATIC`, D a multiple of the vector loop's width; else None (the module runs each step)."""
        fits = device.type == "cpu" and head_dim % VECTOR == 0
        return RopeTable(rotary, head_dim, dtype) if fits and getattr(rotary, "rope_type", None) in STATIC else None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> [T, D] each
        end = int(positions.max()) + 1
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def _grow(self, end: int) -> None:
        """Rows up to the next power of two at or past `end`, `max_rows` positions a call."""
        size = 1 << (end - 1).bit_length()
        new = torch.arange(self.cos.shape[0], size)
        parts = [rotary_rows(self.rotary, self.like, p) for p in new.split(self.max_rows)]
        self.cos = torch.cat([self.cos, *(c for c, _ in parts)])
        self.sin = torch.cat([self.sin, *(s for _, s in parts)])

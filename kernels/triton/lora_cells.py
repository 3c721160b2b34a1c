"""The dispatch table's `lora_sgmv` and `lora_batched` cells for the engine on the Triton path: the
kernels of kernels/triton/lora.py over descriptors and scratch allocated once on the model's
device (docs/lora.md "The Triton kernels in the engine").

A step's segments (each adapter slot's rows, the slot, its scale) are written into one int32
buffer on the device, allocated at start for the most rows a forward takes and `max_loras`
segments: one host-to-device copy per step's batch (its calls, four a layer, reuse it), none per
projection, and nothing allocated per step. The shrink's fp32 intermediate `[rows, R_PAD]` is a
scratch of the same lifetime. A call with more rows or segments than the buffers hold (none in the
engine: they are sized from its limits) builds its own, as `Segments.of` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from orcaserve.kernels.cpu.lora import row_indices
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, Part
from orcaserve.kernels.triton.lora import Segments, rank_pad, segmented_update


class SegmentBuffers:
    """One int32 buffer on `device`: order [max_rows], starts [max_segments + 1], slots
    [max_segments], scales [max_segments] (fp32 bits); and the shrink's fp32 scratch."""

    def __init__(self, max_rows: int, max_segments: int, max_rank: int, device: torch.device | str) -> None:
        self.max_rows, self.max_segments, self.max_rank = max_rows, max_segments, max_rank
        self.ints = torch.zeros(max_rows + 3 * max_segments + 1, dtype=torch.int32, device=device)
        self.scratch = torch.empty(max_rows * rank_pad(max_rank), dtype=torch.float32, device=device)
        self.uploads = 0  # host-to-device copies made (one per step's batch)

    def fill(self, groups: Sequence[tuple[torch.Tensor, int, float]]) -> Segments | None:
        """`Segments.of(groups)` as views of the buffer (one copy); None when no row is left."""
        groups = [g for g in groups if g[0].numel()]
        if not groups:
            return None
        n, g = sum(int(rows.numel()) for rows, _, _ in groups), len(groups)
        if n > self.max_rows or g > self.max_segments:
            return Segments.of(groups, self.ints.device)
        counts = [int(rows.numel()) for rows, _, _ in groups]
        host = torch.empty(n + 3 * g + 1, dtype=torch.int32)
        host[:n] = torch.cat([rows.cpu().to(torch.int32) for rows, _, _ in groups])
        host[n : n + g + 1] = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        host[n + g + 1 : n + 2 * g + 1] = torch.tensor([slot for _, slot, _ in groups], dtype=torch.int32)
        scales = torch.tensor([sc for _, _, sc in groups], dtype=torch.float32)
        host[n + 2 * g + 1 :] = scales.view(torch.int32)
        dev = self.ints[: host.numel()]
        dev.copy_(host)  # pageable: the host tensor may go at once
        self.uploads += 1
        order, starts, slots = dev[:n], dev[n : n + g + 1], dev[n + g + 1 : n + 2 * g + 1]
        return Segments(order, starts, slots, dev[n + 2 * g + 1 :].view(torch.float32), g, max(counts))

    def h(self, seg: Segments, rank: int) -> torch.Tensor | None:
        """The shrink's intermediate for `seg` at `rank`, a view of the scratch (None: too large)."""
        size = seg.order.numel() * rank_pad(rank)
        return self.scratch[:size].view(-1, rank_pad(rank)) if size <= self.scratch.numel() else None


class TritonLora:
    """`sgmv` and `parts`: the Triton twins of `lora_sgmv` and `lora_batched_parts` over `buffers`.
    The segments of the last batch (or of the last one-adapter rows and scale) are kept, so a
    step's calls share one upload; the key object is held, so its identity cannot be reused."""

    def __init__(self, buffers: SegmentBuffers) -> None:
        self.buffers = buffers
        self.max_rank = buffers.max_rank  # the stacks' rank on this path (scheduler/lora/resident.py)
        self._key: Any = None
        self._seg: Segments | None = None

    def _segments(self, key: Any, groups: Any) -> Segments | None:
        if self._key is None or key[0] is not self._key[0] or key[1:] != self._key[1:]:
            self._seg, self._key = self.buffers.fill(groups()), key
        return self._seg

    def sgmv(self, y: torch.Tensor, x: torch.Tensor, groups: Sequence[LoraGroup]) -> None:
        """One adapter's groups (the engine's one-adapter steps and prompt forwards): slot 0 of
        its own A [r, in] and B [out, r]."""
        if not groups:
            return
        a, b = groups[0].a, groups[0].b
        if any(g.a is not a for g in groups):  # several adapters: the module's padded stack
            from orcaserve.kernels.triton.lora import lora_sgmv

            lora_sgmv(y, x, groups)
            return
        key = (groups[0].rows, len(groups), tuple(g.scale for g in groups))
        seg = self._segments(key, lambda: [(row_indices(g.rows).cpu(), 0, g.scale) for g in groups])
        if seg is not None:
            segmented_update(y, x, seg, a, b, a.shape[0], self.buffers.h(seg, a.shape[0]))

    def parts(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, parts: Sequence[Part]) -> None:
        """Each projection of a fused output: the stacks as they are, one segment per slot present."""

        def groups() -> list[tuple[torch.Tensor, int, float]]:
            rows = torch.tensor(batch.slot_of, dtype=torch.int64)
            return [(torch.nonzero(rows == s).flatten(), s, batch.scales[s]) for s in batch.present]

        seg = self._segments((batch,), groups)
        if seg is None:
            return
        h = self.buffers.h(seg, batch.rank)
        for first, last, a, b in parts:
            segmented_update(y[:, first:last], x, seg, a, b, batch.rank, h)

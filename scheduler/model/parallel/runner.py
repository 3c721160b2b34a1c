"""`TPModelRunner`: the model runner of one rank of a split model (docs/tensor-parallel.md,
"One scheduler, N forwards").

Rank 0's runner is the engine's: `execute` writes the step's inputs as one process would
(`StepBuffers.prepare`), broadcasts them as one packed tensor (a header of sizes, then the staging
buffer's bytes) and runs its share of the forward. The other ranks hold no request state: `serve`
receives each packed step into the same buffers and runs the same forward, until rank 0 sends
STOP. All ranks size their buffers from the same config, so the bytes line up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from orcaserve.kernels import AttentionBackend
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.model.decoder import Decoder
from orcaserve.scheduler.model.model_runner import CausalLM, ModelRunner
from orcaserve.scheduler.model.parallel.decoder import ShardedDecoder
from orcaserve.scheduler.model.parallel.group import HEADER, STEP, STOP, RankFailure, TPGroup
from orcaserve.scheduler.model.step_buffers import StepShape

log = logging.getLogger(__name__)


class TPModelRunner(ModelRunner):
    """`ModelRunner` whose forward runs on every rank of `group` (the lean decoder only)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        *,
        group: TPGroup,
        **sizes: Any,
    ) -> None:
        self.group = group
        super().__init__(model, kv_caches, block_size, backend, device, **sizes)
        self.use_graphs = False  # a graph would hold the collectives too: not built (docs/tensor-parallel.md)
        staging = self.buffers.host_bytes  # [nbytes] uint8, the step's inputs as prepare() writes them
        self.packed = torch.zeros(HEADER * 8 + staging.numel(), dtype=torch.uint8)  # [header | staging]
        self.header = self.packed[: HEADER * 8].view(torch.int64)  # [HEADER]
        self.processes: list[Any] = []  # ranks this process started (launch.py), joined by close()
        self.on_failure: Callable[[BaseException], None] | None = None  # told once when a rank is gone

    def _make_decoder(self, model: CausalLM) -> Decoder:
        return ShardedDecoder(model, self.group)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Rank 0: broadcast the step, run it; logits `[S, V]` (gathered from every rank)."""
        if self.group.broken:
            raise RankFailure("a rank of this model failed earlier")
        shape = self.buffers.prepare(sched, kv)
        self.header[0] = STEP
        self.header[1:7] = torch.tensor(
            [shape.num_tokens, shape.num_seqs, shape.num_samples, shape.width, shape.max_seqlen_q, shape.max_seqlen_k]
        )
        self.packed[HEADER * 8 :].copy_(self.buffers.host_bytes)
        try:
            self.group.broadcast(self.packed)
            return self._forward(shape)
        except Exception as e:
            self.group.broken = True  # the other ranks may wait in a collective this rank never reaches
            if self.on_failure is not None:
                self.on_failure(e)
                self.on_failure = None
            raise

    @torch.inference_mode()
    def serve(self) -> None:
        """Ranks other than 0: run every step rank 0 broadcasts, until it sends STOP."""
        while True:
            self.group.broadcast(self.packed)
            if int(self.header[0]) == STOP:
                return
            self.buffers.host_bytes.copy_(self.packed[HEADER * 8 :])
            self._forward(StepShape(*(int(v) for v in self.header[1:7])))

    def _forward(self, shape: StepShape) -> torch.Tensor:
        assert isinstance(self.decoder, ShardedDecoder)
        self.buffers.upload(shape)
        t = self.buffers.tensors(shape.num_tokens, shape.num_seqs, shape.num_samples, shape.width)
        plan = self.backend.plan(
            t.cu_seqlens_q, t.seq_lens, t.block_tables, self.block_size, shape.max_seqlen_q, shape.max_seqlen_k
        )
        self.decoder.in_step = True
        try:
            return self.decoder.forward(
                t.input_ids, t.positions, t.sample_rows, self.backend, plan, t.slot_mapping, self.kv_caches
            )
        finally:
            self.decoder.in_step = False

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for the ones this process started, leave the group."""
        if self.group.rank == 0 and not self.group.broken:
            self.header[0] = STOP
            try:
                self.group.broadcast(self.packed)
            except RankFailure:
                pass
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.processes = []
        self.group.close()

"""The ranks of one tensor-parallel model: their process group and the step's collectives
(docs/tensor-parallel.md, "One scheduler, N forwards").

Gloo on the CPU. Rank 0 owns the engine; every step it broadcasts one packed tensor (`StepMessage`)
and all ranks run the forward. A collective that fails (a rank died: gloo sees its socket close)
raises `RankFailure`; the group is then broken for good and every later step fails at once,
never waiting on a peer that is gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STEP, STOP = 1, 2
HEADER = 8  # int64 slots before the payload: op, then the StepShape's six sizes, one spare
_TIMEOUT = datetime.timedelta(minutes=10)


class RankFailure(RuntimeError):
    """A collective between the ranks failed: a rank is gone; the model cannot run any more."""


@dataclass
class TPGroup:
    """This process's place among the ranks of one model."""

    rank: int
    world: int
    broken: bool = False
    seconds: float = 0.0  # spent in the step's collectives (waiting for the slowest rank included)

    @classmethod
    def join(cls, rank: int, world: int, init_method: str) -> TPGroup:
        """Join (or, the first time in this process, create) the default gloo group at
        `init_method` (tcp://host:port)."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=_TIMEOUT)
        return cls(rank, world)

    def _call(self, fn, *args, **kwargs) -> None:
        if self.broken:
            raise RankFailure("a rank of this model failed earlier")
        started = time.perf_counter()
        try:
            fn(*args, **kwargs)
            self.seconds += time.perf_counter() - started
        except Exception as e:  # gloo raises RuntimeError (or DistBackendError) when a peer is gone
            self.broken = True
            raise RankFailure(f"collective {fn.__name__} failed on rank {self.rank}: {e}") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self._call(dist.all_reduce, x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (load time: sizes every rank must share)."""
        x = torch.tensor([value], dtype=torch.int64)
        self._call(dist.all_reduce, x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:  # [S, V_r] -> [S, N V_r] on rank 0
        """The ranks' column blocks side by side on rank 0 (None elsewhere)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        self._call(dist.gather, x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None

    def broadcast(self, packed: torch.Tensor) -> None:
        """Rank 0's `packed` into every rank's (the same size everywhere)."""
        self._call(dist.broadcast, packed, src=0)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_threads(world: int, total: int | None = None) -> int:
    """torch threads per rank: the cores (or `total`) shared out, at least one each."""
    return max(1, (total or os.cpu_count() or 1) // world)

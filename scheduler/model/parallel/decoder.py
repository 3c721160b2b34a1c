"""The lean decoder over one rank's slices (docs/tensor-parallel.md, "How a layer is split").

`Decoder` runs unchanged over the rank's heads and intermediate rows; three things are added:
the o and down projections' partial outputs are summed over the ranks (one all-reduce each per
layer, Megatron's row-parallel layers), the embedding looks up only the rank's vocabulary rows
and the all-reduce fills in the others', and the lm_head's column blocks of the sampled rows are
gathered on rank 0. Sums over ranks add the partial products in another order than one process
does: fp32 logits differ in their last bits, a greedy token only where the top two are that close.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from orcaserve.scheduler.model.decoder import Decoder
from orcaserve.scheduler.model.parallel.group import TPGroup
from orcaserve.scheduler.model.parallel.shard import TensorParallelUnsupported


class _AllReduced:
    """A row-parallel linear layer: the rank's partial product, summed over the ranks."""

    def __init__(self, linear: Any, group: TPGroup) -> None:
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))

    def __getattr__(self, name: str) -> Any:  # in_features, onednn, ...: the wrapped layer's
        return getattr(self.linear, name)


class ShardedDecoder(Decoder):
    """`Decoder` on rank `group.rank` of a model split by `parallel/shard.py`. `forward` returns
    the logits `[S, V]` on rank 0 and an empty tensor on the others."""

    def __init__(self, model: Any, group: TPGroup, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.head_argmax = False  # the lm_head's columns are split over the ranks (_head gathers them)
        self.group = group
        self.vocab: int = model.config.vocab_size  # V
        self.vocab_rows: int = self.embed.shape[0]  # V_r
        self.vocab_start = group.rank * self.vocab_rows
        self.in_step = False  # set by the runner around a broadcast step (runner.py)
        for layer in self.layers:
            layer.o = _AllReduced(layer.o, group)
            layer.down = _AllReduced(layer.down, group)
        self.layer_call = None  # the one-call layer has no all-reduce between its GEMMs

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`Decoder.forward` inside a step every rank runs; a forward of rank 0 alone (a prompt's
        log-probabilities, prompt_logprobs.py) would wait forever on the others: refused."""
        if not self.in_step:
            raise TensorParallelUnsupported(
                "prompt log-probabilities (echo with logprobs) are not computed under tensor parallelism"
            )
        return super().forward(*args, **kwargs)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)  # [T]: another rank's rows
        x = F.embedding(local.clamp(0, self.vocab_rows - 1), self.embed)
        x.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)  # one rank's row plus zeros: exact

    def _head(self, last: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V] on rank 0
        full = self.group.gather_cols(self.lm_head(last))  # [S, N V_r]
        return full[:, : self.vocab] if full is not None else last.new_empty(0)

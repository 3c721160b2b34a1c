"""Which slice of each weight a rank holds: Megatron-style splits of a Llama-family decoder
(docs/tensor-parallel.md, "How a layer is split").

Column-parallel (output rows split): q, k, v by attention head, gate and up by intermediate row.
Row-parallel (input columns split): o and down, whose partial outputs one all-reduce sums. The
embedding and the lm_head are split by vocabulary row, padded to a multiple of the ranks. KV heads
are split too; where there are fewer KV heads than ranks each KV head is replicated on the ranks
whose query heads read it. Norms and rotary tables are replicated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


class TensorParallelUnsupported(ValueError):
    """What cannot be served split over ranks; raised before any weight is read."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world` over a model of H query heads, H_kv KV heads of D dims, I
    intermediate rows and a vocabulary of V tokens (V_r rows per rank, the last rank's padded)."""

    rank: int
    world: int
    heads: int  # H
    kv_heads: int  # H_kv
    head_dim: int  # D
    intermediate: int  # I
    vocab: int  # V

    @classmethod
    def of(cls, cfg: Any, rank: int, world: int) -> Shard:
        """The shard of a transformers config; refuses sizes that do not split evenly."""
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        shard = cls(rank, world, heads, kv, head_dim, cfg.intermediate_size, cfg.vocab_size)
        if heads % world or cfg.intermediate_size % world or (kv % world and world % kv):
            raise TensorParallelUnsupported(
                f"tensor_parallel_size={world} does not split {heads} attention heads, {kv} KV heads "
                f"and {cfg.intermediate_size} intermediate rows evenly (each must be a multiple of it, "
                "or the KV heads a divisor of it)"
            )
        return shard

    @property
    def local_heads(self) -> int:
        return self.heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.world)

    @property
    def vocab_rows(self) -> int:  # V_r
        return -(-self.vocab // self.world)

    def kv_start(self) -> int:
        """The first KV head this rank holds: its query heads' group where KV heads are replicated."""
        if self.kv_heads >= self.world:
            return self.rank * self.local_kv_heads
        return self.rank * self.local_heads // (self.heads // self.kv_heads)

    def rows(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of `name`'s slice along dim, or None where the tensor is replicated.
        Vocabulary slices may stop past V: the loader pads them with zero rows."""
        d, leaf = self.head_dim, name.rsplit(".", 2)
        proj = leaf[-2] if len(leaf) >= 2 else ""
        bias = name.endswith(".bias")
        if name in (EMBED, HEAD):
            return 0, self.rank * self.vocab_rows, (self.rank + 1) * self.vocab_rows
        if proj == "q_proj":
            start = self.rank * self.local_heads * d
            return 0, start, start + self.local_heads * d
        if proj in ("k_proj", "v_proj"):
            start = self.kv_start() * d
            return 0, start, start + self.local_kv_heads * d
        if proj in ("gate_proj", "up_proj"):
            n = self.intermediate // self.world
            return 0, self.rank * n, (self.rank + 1) * n
        if proj == "o_proj" and not bias:
            start = self.rank * self.local_heads * d
            return 1, start, start + self.local_heads * d
        if proj == "down_proj" and not bias:
            n = self.intermediate // self.world
            return 1, self.rank * n, (self.rank + 1) * n
        return None  # norms; the row-parallel layers' biases (`bias_elsewhere`)

    def bias_elsewhere(self, name: str) -> bool:
        """True for an o or down bias on a rank other than 0: added once, by rank 0, before the
        all-reduce sums the partial outputs, so the other ranks hold zeros."""
        return self.rank > 0 and name.endswith((".o_proj.bias", ".down_proj.bias"))

    def local_config(self, cfg: Any) -> Any:
        """`cfg` with this rank's head and intermediate counts (the vocabulary stays V: the engine
        samples over all of it); head_dim explicit, so the rotary tables stay the model's."""
        local = copy.deepcopy(cfg)
        local.num_attention_heads = self.local_heads
        local.num_key_value_heads = self.local_kv_heads
        local.intermediate_size = self.intermediate // self.world
        local.head_dim = self.head_dim
        return local

"""Which slice of each weight a rank holds: Megatron-style splits of a Llama-family decoder
(docs/tensor-parallel.md, "How a layer is split").

Column-parallel (output rows split): q, k, v by attention head, gate and up by intermediate row.
Row-parallel (input columns split): o and down, whose partial outputs one all-reduce sums. The
embedding and the lm_head are split by vocabulary row, padded to a multiple of the ranks. Heads go
by KV head, each with the query heads that read it; where the KV heads do not divide evenly the
ranks differ by one KV head (SmolLM2's 3 over 2 ranks: 1 and 2), and where there are fewer KV
heads than ranks each is replicated on the ranks whose query heads read it. Norms and rotary
tables are replicated.
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
        """The shard of a transformers config; refuses head counts that cannot be shared out."""
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if kv < world and (world % kv or heads % world):
            raise TensorParallelUnsupported(
                f"tensor_parallel_size={world} does not split {heads} attention heads over {kv} KV heads: "
                "with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and divide the heads"
            )
        return cls(rank, world, heads, kv, head_dim, cfg.intermediate_size, cfg.vocab_size)

    def kv_range(self) -> tuple[int, int]:
        """The KV heads this rank holds: an even share (ranks differ by one at most where they do
        not divide evenly), or its query heads' one KV head where there are fewer than ranks."""
        kv, w, r = self.kv_heads, self.world, self.rank
        if kv >= w:
            return kv * r // w, kv * (r + 1) // w
        first = r // (w // kv)
        return first, first + 1

    def q_range(self) -> tuple[int, int]:
        """The query heads this rank holds: those reading its KV heads (or its share of them)."""
        if self.kv_heads >= self.world:
            group = self.heads // self.kv_heads
            start, stop = self.kv_range()
            return start * group, stop * group
        n = self.heads // self.world
        return self.rank * n, (self.rank + 1) * n

    def i_range(self) -> tuple[int, int]:
        """The intermediate (MLP) rows this rank holds."""
        i, w, r = self.intermediate, self.world, self.rank
        return i * r // w, i * (r + 1) // w

    @property
    def local_heads(self) -> int:
        start, stop = self.q_range()
        return stop - start

    @property
    def local_kv_heads(self) -> int:
        start, stop = self.kv_range()
        return stop - start

    @property
    def vocab_rows(self) -> int:  # V_r
        return -(-self.vocab // self.world)

    def rows(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of `name`'s slice along dim, or None where the tensor is replicated.
        Vocabulary slices may stop past V: the loader pads them with zero rows."""
        d, leaf = self.head_dim, name.rsplit(".", 2)
        proj = leaf[-2] if len(leaf) >= 2 else ""
        bias = name.endswith(".bias")
        q, kv, i = self.q_range(), self.kv_range(), self.i_range()
        if name in (EMBED, HEAD):
            return 0, self.rank * self.vocab_rows, (self.rank + 1) * self.vocab_rows
        if proj == "q_proj":
            return 0, q[0] * d, q[1] * d
        if proj in ("k_proj", "v_proj"):
            return 0, kv[0] * d, kv[1] * d
        if proj in ("gate_proj", "up_proj"):
            return 0, i[0], i[1]
        if proj == "o_proj" and not bias:
            return 1, q[0] * d, q[1] * d
        if proj == "down_proj" and not bias:
            return 1, i[0], i[1]
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
        local.intermediate_size = self.i_range()[1] - self.i_range()[0]
        local.head_dim = self.head_dim
        return local

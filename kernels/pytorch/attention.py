"""PyTorch attention: `TorchAttentionPlan` is the engine's fallback CPU path (`attention_backend=
"torch"`, or when the C++ operator cannot load); `unified_attention` and `store_kv` are the test
oracle of the C++ operator and of the Triton kernels.

Shapes used throughout (gpt-fast style):
    T        tokens scheduled this step, all requests packed
    B        requests in the step
    H, H_kv  query heads, key/value heads (H % H_kv == 0)
    D        head dim
    cache    [num_blocks, block_size, H_kv, D]

`store_kv` and `unified_attention` have the same positional signatures as their Triton versions
in `orcaserve.kernels.triton.attention`. The CPU engine does not call `unified_attention` per layer;
it builds a `TorchAttentionPlan` once per step (gather indices and masks are the same for all
layers) and calls `plan.attend(...)` per layer. `unified_attention` is the same computation,
planned on the spot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [T, H_kv, D], any strides
    value: torch.Tensor,  # [T, H_kv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * block_size + offset; -1 = skip
) -> None:
    """Scatter this step's new keys and values into their cache slots."""
    n_kv, d = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, n_kv, d)  # [num_slots, H_kv, D]
    v_flat = v_cache.view(-1, n_kv, d)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    else:
        slots = slot_mapping[valid]
        k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


# Fixed cost of one more decode group per layer (two gathers, an SDPA call, a scatter), in units
# of one request's block of keys, measured on a 2-core CPU with SmolLM2's heads
# (docs/performance-log.md#figures-from-code-comments).
GROUP_OVERHEAD_BLOCKS = 10


def decode_groups(decodes: list[int], blocks_of: list[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[list[int]]:
    """Partition decode requests into groups that each pad to their own longest context.

    One group pads every request to the longest context of the step: with contexts of 10 and
    250 tokens in one batch, most of the gathered keys are padding. Sorted by block count, the
    cheapest split into contiguous runs (cost per group: `overhead` + members x longest blocks)
    is found by dynamic programming over the points where the block count changes.
    """
    order = sorted(decodes, key=lambda i: blocks_of[i])
    if len(order) <= 1:
        return [order] if order else []
    nbs = [blocks_of[i] for i in order]
    cuts = [j for j in range(1, len(nbs)) if nbs[j] != nbs[j - 1]] + [len(nbs)]
    starts = [0] + cuts[:-1]
    best = [0] * (len(cuts) + 1)  # best[c]: cost of covering order[:cuts[c-1]]
    prev = [0] * (len(cuts) + 1)
    for c in range(1, len(cuts) + 1):
        end = cuts[c - 1]
        best[c], prev[c] = min((best[a] + overhead + (end - starts[a]) * nbs[end - 1], a) for a in range(c))
    groups = []
    c = len(cuts)
    while c:
        a = prev[c]
        groups.append(order[starts[a] : cuts[c - 1]])
        c = a
    return groups[::-1]


@dataclass
class _Group:
    """Requests attended together: decodes batched, each prefill chunk on its own."""

    token_index: torch.Tensor  # [Bg * Q] rows of q/out this group reads and writes
    block_index: torch.Tensor  # [Bg * NB] cache blocks to gather, padded with block 0
    mask: torch.Tensor | None  # [Bg, 1, Q, NB * block_size] True = attend; None = causal
    key_valid: torch.Tensor  # [Bg, NB * block_size] True where the slot holds this request's key
    num_seqs: int
    num_queries: int  # Q, queries per request in this group
    num_blocks: int  # NB


def _decode_group(
    members: list[int],
    cu: list[int],
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    nb: int,
    block_size: int,
    window: int | None = None,
) -> _Group:
    """Decodes batched into one SDPA call, all padded to the group's longest context (nb blocks)."""
    device = block_tables.device
    idx = torch.tensor(members, device=device, dtype=torch.long)
    blocks = block_tables[idx, :nb].long()  # [Bd, NB]
    pos = torch.arange(nb * block_size, device=device)
    ctx = seq_lens[idx].long()
    valid = pos[None, :] < ctx[:, None]  # [Bd, NB*bs]
    # The query sits at ctx - 1; a sliding window keeps keys at positions > ctx - 1 - window.
    mask = (valid if window is None else valid & (pos[None, :] >= ctx[:, None] - window))[:, None, None, :]
    return _Group(
        token_index=torch.tensor([cu[i] for i in members], device=device),
        block_index=blocks.reshape(-1),
        mask=mask,
        key_valid=valid,
        num_seqs=len(members),
        num_queries=1,
        num_blocks=nb,
    )


def _prefill_group(
    first: int, n: int, ctx: int, table: torch.Tensor, block_size: int, window: int | None = None
) -> _Group:
    """One request's `n` new tokens (rows `first` ..) over its `ctx` keys, causal; with a sliding
    `window`, each query sees only the last `window` positions up to its own (transformers' rule)."""
    device = table.device
    nb = (ctx + block_size - 1) // block_size
    if ctx == n and nb * block_size == ctx and (window is None or ctx <= window):
        mask = None  # no history, no padding, nothing outside the window: plain causal attention
    else:
        # Query j sits at absolute position ctx - n + j and sees keys 0 ..= that position.
        q_pos = torch.arange(ctx - n, ctx, device=device)
        k_pos = torch.arange(nb * block_size, device=device)
        seen = k_pos[None, :] <= q_pos[:, None]  # [n, NB*bs]
        if window is not None:
            seen &= k_pos[None, :] > q_pos[:, None] - window
        mask = seen[None, None]  # [1, 1, n, NB*bs]
    return _Group(
        token_index=torch.arange(first, first + n, device=device),
        block_index=table[:nb].long(),
        mask=mask,
        key_valid=(torch.arange(nb * block_size, device=device) < ctx)[None],
        num_seqs=1,
        num_queries=n,
        num_blocks=nb,
    )


class TorchAttentionPlan:
    """Per-step attention layout for the PyTorch path, shared by every layer.

    Decode requests (one new token) are batched into one SDPA call over block-gathered K/V.
    Requests with several new tokens (prefill chunks, recomputation after preemption) are attended
    one by one: each is a large matrix product already, and a padded batch of them would waste
    far more than the Python loop over a handful of requests costs.
    """

    def __init__(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        seq_lens: torch.Tensor,  # [B] int32, cached + new tokens per request
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        block_size: int,
        window: int | None = None,  # attend only to the last `window` positions (sliding window)
    ) -> None:
        cu = cu_seqlens_q.tolist()
        lens = seq_lens.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        blocks_of = [(n + block_size - 1) // block_size for n in lens]
        self.groups: list[_Group] = [
            _decode_group(members, cu, seq_lens, block_tables, blocks_of[members[-1]], block_size, window)
            for members in decode_groups(decodes, blocks_of)
        ]
        self.groups += [
            _prefill_group(cu[i], n, lens[i], block_tables[i], block_size, window)
            for i, n in enumerate(q_lens)
            if n > 1
        ]

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D]
        finite_cache: bool = True,
    ) -> torch.Tensor:
        """Attention of every query over its request's cached keys (already stored).

        With `finite_cache` the slots past each request's context are assumed to hold finite
        values (the engine zero-fills its cache; stale keys of other requests are finite), so
        masking alone suffices. Without it those slots are zeroed after the gather, which costs
        a pass over K/V but makes NaN-poisoned test caches safe.
        """
        t, h, d = q.shape
        _, bs, n_kv, _ = k_cache.shape
        g = h // n_kv
        if out is None:
            out = q.new_empty(t, h, d)
        for grp in self.groups:
            b, nq, keys = grp.num_seqs, grp.num_queries, grp.num_blocks * bs
            k = k_cache.index_select(0, grp.block_index).view(b, keys, n_kv, d).transpose(1, 2)
            v = v_cache.index_select(0, grp.block_index).view(b, keys, n_kv, d).transpose(1, 2)
            if not finite_cache:
                valid = grp.key_valid[:, None, :, None]  # [b, 1, keys, 1]
                k, v = k.nan_to_num(0.0) * valid, v.nan_to_num(0.0) * valid
            qg = q.index_select(0, grp.token_index)  # [b * nq, H, D]
            if nq == 1:
                # Decodes: the g query heads of one KV head become g query rows, so K/V are read
                # once per KV head with no repeat_interleave copy; the mask broadcasts over rows.
                qg = qg.view(b, n_kv, g, d)  # [b, H_kv, g, D]
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=grp.mask, scale=scale)
            else:
                qg = qg.view(b, nq, h, d).transpose(1, 2)  # [1, H, nq, D]
                o = F.scaled_dot_product_attention(
                    qg,
                    k,
                    v,
                    attn_mask=grp.mask,
                    is_causal=grp.mask is None,
                    scale=scale,
                    enable_gqa=g > 1,
                ).transpose(1, 2)  # [1, nq, H, D]
            out.index_copy_(0, grp.token_index, o.reshape(b * nq, h, d).to(out.dtype))
        return out


def unified_attention(
    q: torch.Tensor,  # [T, H, D] packed queries of all requests
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], this step's K/V already stored
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:
    """Ragged paged attention: prefill chunks and decodes in one call, causal per request.

    The queries of request b are the last `cu_seqlens_q[b+1] - cu_seqlens_q[b]` positions of its
    `seq_lens[b]` tokens; each attends to all keys at or before its own position.
    """
    plan = TorchAttentionPlan(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    return plan.attend(q, k_cache, v_cache, scale, out, finite_cache=False)

"""Paged-attention test cases shared by the C++, Triton and PyTorch attention tests."""

from __future__ import annotations

import torch

# (name, new tokens per request, context length per request incl. new tokens); bs = block size.
SCENARIOS = [
    ("seq_len_1", lambda bs: ([1], [1])),
    ("block_boundaries_decode", lambda bs: ([1, 1, 1, 1], [bs - 1, bs, bs + 1, 2 * bs])),
    ("block_boundaries_prefill", lambda bs: ([bs - 1, bs, bs + 1], [bs - 1, bs, bs + 1])),
    ("zero_new_tokens", lambda bs: ([0, 3, 0, 1, 0], [10, 20, 5, 33, 0])),
    ("pure_decode", lambda bs: ([1, 1, 1], [70, 3, 129])),
    ("pure_prefill", lambda bs: ([37, 16], [37, 16])),
    ("chunked_prefill_mix", lambda bs: ([1, 20, 1, 7, 0], [70, 45, 3, 47, 9])),
]


def make_case(
    q_lens: list[int], ctx: list[int], h: int, h_kv: int, d: int, bs: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables) with shuffled block tables; every
    slot a request does not own (tails of its blocks, unused blocks, the table's padding column)
    holds NaN, so reading one shows."""
    g = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    per_req = [max(1, -(-c // bs)) for c in ctx]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((b, max(per_req) + 1), int(perm[-1]), dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    used = 0
    for i, c in enumerate(ctx):
        tables[i, : per_req[i]] = perm[used : used + per_req[i]].to(torch.int32)
        used += per_req[i]
        slots = tables[i].long().repeat_interleave(bs)[:c] * bs + torch.arange(c) % bs  # [c]
        k_cache.view(-1, h_kv, d)[slots] = torch.randn(c, h_kv, d, generator=g).to(dtype)
        v_cache.view(-1, h_kv, d)[slots] = torch.randn(c, h_kv, d, generator=g).to(dtype)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, cu, torch.tensor(ctx, dtype=torch.int32), tables

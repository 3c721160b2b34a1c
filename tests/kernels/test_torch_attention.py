"""The PyTorch paged attention (the CPU engine's path and the Triton oracle) against dense attention."""

import itertools
import math

import torch

from orcaserve.kernels.pytorch.attention import decode_groups, unified_attention


def _cost(groups, blocks_of, overhead):
    return sum(overhead + len(g) * max(blocks_of[i] for i in g) for g in groups)


def test_decode_groups_is_an_optimal_partition():
    """Every decode lands in exactly one group, and no split into contiguous runs of the
    block-sorted order costs less (checked exhaustively on small cases)."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = 1 + trial % 8
        blocks_of = torch.randint(1, 20, (n + 2,), generator=rng).tolist()
        decodes = sorted(torch.randperm(n + 2, generator=rng)[:n].tolist())
        overhead = [0, 3, 10, 50][trial % 4]
        groups = decode_groups(decodes, blocks_of, overhead)
        assert sorted(i for g in groups for i in g) == decodes
        order = sorted(decodes, key=lambda i: blocks_of[i])
        best = math.inf
        for mask in itertools.product([False, True], repeat=n - 1):
            runs, cur = [], [order[0]]
            for cut, i in zip(mask, order[1:]):
                if cut:
                    runs.append(cur)
                    cur = []
                cur.append(i)
            runs.append(cur)
            best = min(best, _cost(runs, blocks_of, overhead))
        assert _cost(groups, blocks_of, overhead) == best
    assert decode_groups([], [3]) == []
    # Far-apart contexts split; a huge overhead keeps one group.
    assert decode_groups([0, 1, 2], [1, 40, 1], 10) == [[0, 2], [1]]
    assert decode_groups([0, 1, 2], [1, 40, 1], 1000) == [[0, 2, 1]]


def test_unified_attention_matches_dense_attention():
    """Decodes of very different lengths (several groups), prefill chunks with history and a
    fresh prompt, over shuffled blocks whose unused slots hold NaN."""
    g = torch.Generator().manual_seed(1)
    h, h_kv, d, bs = 6, 2, 32, 16
    q_lens = [1, 5, 1, 1, 17, 1, 1, 32]
    ctx = [3, 40, 250, 17, 17, 129, 4, 32]
    per_req = [-(-c // bs) for c in ctx]
    num_blocks = sum(per_req) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(ctx), max(per_req)), int(perm[-1]), dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, h_kv, d), float("nan"))
    v_cache = k_cache.clone()
    keys, values, used = [], [], 0
    for i, c in enumerate(ctx):
        tables[i, : per_req[i]] = perm[used : used + per_req[i]].to(torch.int32)
        used += per_req[i]
        k, v = torch.randn(2, c, h_kv, d, generator=g)
        keys.append(k)
        values.append(v)
        for p in range(c):
            k_cache[tables[i, p // bs], p % bs] = k[p]
            v_cache[tables[i, p // bs], p % bs] = v[p]
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=g)
    out = unified_attention(q, k_cache, v_cache, cu, torch.tensor(ctx, dtype=torch.int32), tables, 0.2)
    for i, (n, c) in enumerate(zip(q_lens, ctx)):
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)  # [H, n, D]
        ki = keys[i].repeat_interleave(h // h_kv, 1).transpose(0, 1)  # [H, c, D]
        vi = values[i].repeat_interleave(h // h_kv, 1).transpose(0, 1)
        allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]  # [n, c]
        scores = (qi @ ki.transpose(1, 2) * 0.2).masked_fill(~allowed, float("-inf"))
        want = (scores.softmax(-1) @ vi).transpose(0, 1)  # [n, H, D]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], want, atol=1e-5, rtol=1e-4)

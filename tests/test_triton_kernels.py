"""Triton kernels vs the PyTorch reference, run by Triton's CPU interpreter.

TRITON_INTERPRET=1 only takes effect if it is set before the kernels are defined, and another
test module may already have imported them in compiled mode. So each section runs in a fresh
child process (`python tests/test_triton_kernels.py <section>`) with the variable set; pytest only
launches the children and checks their exit status. Tiles are large (few programs) because the
interpreter's cost is per program and per op.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HEADS = [(8, 2), (4, 1), (4, 4)]  # GQA, MQA, MHA: (H, H_kv)
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [16, 32, 64]

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


def make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=0):
    """Shuffled block tables; every slot a request does not own (including the tails of its
    blocks, whole unused blocks and the table's padding entries) holds NaN."""
    g = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    per_req = [max(1, -(-c // bs)) for c in ctx]
    max_blocks = max(per_req) + 1  # one padding column pointing at a poisoned block
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    poison_block = int(perm[-1])
    tables = torch.full((b, max_blocks), poison_block, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    used = 0
    for i, c in enumerate(ctx):
        tables[i, : per_req[i]] = perm[used : used + per_req[i]].to(torch.int32)
        used += per_req[i]
        for p in range(c):
            blk, off = int(tables[i, p // bs]), p % bs
            k_cache[blk, off] = torch.randn(h_kv, d, generator=g).to(dtype)
            v_cache[blk, off] = torch.randn(h_kv, d, generator=g).to(dtype)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, cu, seq_lens, tables


def reference(q, k_cache, v_cache, cu, seq_lens, tables, scale):
    from orcaserve.kernels import reference as ref

    f = torch.float32
    return ref.unified_attention(q.to(f), k_cache.to(f), v_cache.to(f), cu, seq_lens, tables, scale)


def check(out, want, dtype, what):
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert not out.isnan().any(), f"{what}: NaN in output"
    err = (out.float() - want).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


def _cases():
    """Every scenario, rotating through head layouts, head dims and block sizes."""
    for i, (name, fn) in enumerate(SCENARIOS):
        h, h_kv = HEADS[i % len(HEADS)]
        d = HEAD_DIMS[i % len(HEAD_DIMS)]
        bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        yield name, *fn(bs), h, h_kv, d, bs
    for j, d in enumerate(HEAD_DIMS):  # each head dim with each head layout on a mixed step
        h, h_kv = HEADS[j % len(HEADS)]
        yield f"mix_d{d}", [1, 9, 0, 1], [40, 30, 4, 17], h, h_kv, d, BLOCK_SIZES[j % 3]


def section_unified(dtype):
    from orcaserve.kernels.triton_attention import launch_unified

    for name, q_lens, ctx, h, h_kv, d, bs in _cases():
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        # Tile of 32 keys against blocks of 16/32/64: tile size independent of block size.
        out = launch_unified(q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")),
                             block_m=64, tile_n=32)
        check(out, want, dtype, f"unified {name} H{h}/{h_kv} D{d} bs{bs}")


def section_split(dtype):
    from orcaserve.kernels.triton_split_k import launch_split_k

    for i, (name, q_lens, ctx, h, h_kv, d, bs) in enumerate(_cases()):
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=1)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        splits = (2, 3, 7)[i % 3]  # 7 leaves some splits empty for short requests
        out = launch_split_k(q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")),
                             splits, block_m=64, tile_n=16)
        check(out, want, dtype, f"split-K({splits}) {name} H{h}/{h_kv} D{d} bs{bs}")


def section_store(dtype):
    from orcaserve.kernels import reference as ref
    from orcaserve.kernels.triton_store_kv import store_kv

    for i, d in enumerate(HEAD_DIMS):
        h, h_kv = HEADS[i % len(HEADS)]
        bs, t, num_blocks = BLOCK_SIZES[i % 3], 37, 8
        g = torch.Generator().manual_seed(i)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, generator=g).to(dtype)  # fused projection
        key = qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d)  # strided views, no copy
        value = qkv[:, (h + h_kv) * d :].view(t, h_kv, d)
        if i % 2:  # a non-unit head-dim stride too
            value = torch.randn(t, d, h_kv, generator=g).to(dtype).transpose(1, 2)
        slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(torch.int64)
        slots[::5] = -1
        for cache_dtype in (dtype, torch.float32):
            shape = (num_blocks, bs, h_kv, d)
            k1, v1 = torch.full(shape, float("nan"), dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
            k2, v2 = k1.clone(), v1.clone()
            ref.store_kv(key, value, k1, v1, slots)
            store_kv(key, value, k2, v2, slots, block_t=64)
            assert torch.equal(k1.nan_to_num(7.0), k2.nan_to_num(7.0)), f"store_kv K D{d} {cache_dtype}"
            assert torch.equal(v1, v2), f"store_kv V D{d} {cache_dtype}"


def section_dispatch(dtype):
    """Public wrapper (heuristic on: a long-context decode takes split-K) and the backend."""
    from orcaserve.kernels import get_backend
    from orcaserve.kernels.triton_attention import choose_num_splits, unified_attention

    assert choose_num_splits(2, 2, 1, 4, 1, 4096) > 1
    assert choose_num_splits(2, 2, 1, 4, 1, 1024) == 1  # short context
    assert choose_num_splits(256, 256, 8, 4, 1, 32768) == 1  # enough programs already
    q, kc, vc, cu, sl, bt = make_case([1, 1], [2100, 700], 4, 1, 64, 64, dtype, seed=3)
    want = reference(q, kc, vc, cu, sl, bt, 0.125)
    for splits in (None, 1):
        check(unified_attention(q, kc, vc, cu, sl, bt, 0.125, num_splits=splits), want, dtype,
              f"wrapper num_splits={splits}")

    from orcaserve.kernels import reference as ref

    q, kc, vc, cu, sl, bt = make_case([1, 12, 0], [50, 12, 3], 8, 2, 80, 16, dtype, seed=4)
    be = get_backend("triton")
    assert be.name == "triton"
    key, value = torch.randn(2, q.shape[0], 2, 80).to(dtype)
    # This step's tokens: request 0 decodes position 49, request 1 prefills positions 0..11.
    slots = [int(bt[0, 49 // 16]) * 16 + 49 % 16] + [int(bt[1, p // 16]) * 16 + p % 16 for p in range(12)]
    slots = torch.tensor(slots, dtype=torch.int64)
    k_ref, v_ref, k_tri, v_tri = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ref.store_kv(key, value, k_ref, v_ref, slots)
    be.store_kv(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_ref.nan_to_num(7.0), k_tri.nan_to_num(7.0))
    assert torch.equal(v_ref.nan_to_num(7.0), v_tri.nan_to_num(7.0))
    plan = be.plan(cu, sl, bt, 16, 12, 50)
    out = be.attend(plan, q, k_tri, v_tri, 80**-0.5)
    assert plan.num_splits == 1
    check(out, reference(q, k_ref, v_ref, cu, sl, bt, 80**-0.5), dtype, "backend")


SECTIONS = {
    "unified_fp32": lambda: section_unified(torch.float32),
    "unified_fp16": lambda: section_unified(torch.float16),
    "split_fp32": lambda: section_split(torch.float32),
    "split_fp16": lambda: section_split(torch.float16),
    "store_fp32": lambda: section_store(torch.float32),
    "store_fp16": lambda: section_store(torch.float16),
    "dispatch_fp32": lambda: section_dispatch(torch.float32),
    "dispatch_fp16": lambda: section_dispatch(torch.float16),
}


@pytest.mark.parametrize("section", list(SECTIONS))
def test_kernel_section(section):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, section], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    import time

    from orcaserve.kernels import triton_attention

    assert not isinstance(triton_attention._unified_attention_kernel,
                          __import__("triton").runtime.jit.JITFunction), "interpreter not active"
    t0 = time.perf_counter()
    SECTIONS[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok in {time.perf_counter() - t0:.1f} s")

"""Triton kernels vs the PyTorch reference, run by Triton's CPU interpreter (or compiled on a GPU).

TRITON_INTERPRET=1 only takes effect if it is set before the kernels are defined, and another
test module may already have imported them in compiled mode. So each section runs in a fresh
child process (`python tests/kernels/test_triton_kernels.py <section>`) with the variable set; pytest only
launches the children and checks their exit status. Tiles are large (few programs) because the
interpreter's cost is per program and per op.

ORCASERVE_TEST_DEVICE=cuda runs the same sections compiled on the GPU (TRITON_INTERPRET unset in
the children), plus sections the interpreter cannot check: bf16, the production tile configs of
`select_config` (decode and prefill, through `launch_unified`, `launch_split_k` and the public
wrapper), and larger model-like steps (contexts up to ~5k, H=32, G up to 32, split-K up to 64
splits). The reference always runs on the CPU in fp32 from the same (bf16/fp16-rounded) inputs.
Unset or `cpu`: exactly the interpreter run (8 sections).
"""

import os

DEVICE = os.environ.get("ORCASERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from attention_cases import SCENARIOS, make_case  # noqa: E402

pytestmark = pytest.mark.slow  # the Triton interpreter runs every kernel section for minutes

HEADS = [(8, 2), (4, 1), (4, 4)]  # GQA, MQA, MHA: (H, H_kv)
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [16, 32, 64]


def to_dev(*tensors):
    """The kernels' copies of CPU-built inputs (the same tensors on the CPU)."""
    return tuple(t.to(DEVICE) for t in tensors)


def reference(q, k_cache, v_cache, cu, seq_lens, tables, scale):
    from orcaserve.kernels.pytorch import attention as ref

    f = torch.float32
    return ref.unified_attention(q.to(f), k_cache.to(f), v_cache.to(f), cu, seq_lens, tables, scale)


def check(out, want, dtype, what):
    out = out.cpu()
    assert not out.isnan().any(), f"{what}: NaN in output"
    if dtype == torch.bfloat16:  # 8-bit mantissa: output rounding alone is up to 2^-8 relative
        err = (out.float() - want).abs() - 2e-2 * want.abs() if out.numel() else torch.zeros(1)
        assert err.max().item() <= 2e-2, f"{what}: error {err.max().item():.3g} > 2e-2 + 2e-2 * |ref|"
        return
    tol = 2e-5 if dtype == torch.float32 else 1e-2
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
    from orcaserve.kernels.triton.attention import launch_unified

    for name, q_lens, ctx, h, h_kv, d, bs in _cases():
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        q, kc, vc, cu, sl, bt = to_dev(q, kc, vc, cu, sl, bt)
        # Tile of 32 keys against blocks of 16/32/64: tile size independent of block size.
        out = launch_unified(q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")), block_m=64, tile_n=32)
        check(out, want, dtype, f"unified {name} H{h}/{h_kv} D{d} bs{bs}")


def section_split(dtype):
    from orcaserve.kernels.triton.split_k import launch_split_k

    for i, (name, q_lens, ctx, h, h_kv, d, bs) in enumerate(_cases()):
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=1)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        q, kc, vc, cu, sl, bt = to_dev(q, kc, vc, cu, sl, bt)
        splits = (2, 3, 7)[i % 3]  # 7 leaves some splits empty for short requests
        out = launch_split_k(
            q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")), splits, block_m=64, tile_n=16
        )
        check(out, want, dtype, f"split-K({splits}) {name} H{h}/{h_kv} D{d} bs{bs}")


def _store_views(qkv, value_t, h, h_kv, d, dev):
    """Key and value as strided views of a fused projection (value: a non-unit head-dim stride
    when `value_t` is given), made on `dev`: a copy to the device would be contiguous."""
    t = qkv.shape[0]
    base = qkv.to(dev)
    key = base[:, h * d : (h + h_kv) * d].view(t, h_kv, d)  # strided views, no copy
    value = base[:, (h + h_kv) * d :].view(t, h_kv, d)
    if value_t is not None:
        value = value_t.to(dev).transpose(1, 2)
    return key, value


def section_store(dtype):
    from orcaserve.kernels.pytorch import attention as ref
    from orcaserve.kernels.triton.store_kv import store_kv

    for i, d in enumerate(HEAD_DIMS):
        h, h_kv = HEADS[i % len(HEADS)]
        bs, t, num_blocks = BLOCK_SIZES[i % 3], 37, 8
        g = torch.Generator().manual_seed(i)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, generator=g).to(dtype)  # fused projection
        value_t = torch.randn(t, d, h_kv, generator=g).to(dtype) if i % 2 else None
        slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(torch.int64)
        slots[::5] = -1
        key, value = _store_views(qkv, value_t, h, h_kv, d, "cpu")
        key_d, value_d = _store_views(qkv, value_t, h, h_kv, d, DEVICE)
        for cache_dtype in (dtype, torch.float32):
            shape = (num_blocks, bs, h_kv, d)
            k1, v1 = torch.full(shape, float("nan"), dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
            k2, v2 = to_dev(k1, v1)
            if k2 is k1:
                k2, v2 = k1.clone(), v1.clone()
            ref.store_kv(key, value, k1, v1, slots)
            store_kv(key_d, value_d, k2, v2, *to_dev(slots), block_t=64)
            k2, v2 = k2.cpu(), v2.cpu()
            assert torch.equal(k1.nan_to_num(7.0), k2.nan_to_num(7.0)), f"store_kv K D{d} {cache_dtype}"
            assert torch.equal(v1, v2), f"store_kv V D{d} {cache_dtype}"


def section_dispatch(dtype):
    """Public wrapper (heuristic on: a long-context decode takes split-K) and the backend."""
    from orcaserve.kernels import get_backend
    from orcaserve.kernels.triton.attention import choose_num_splits, unified_attention

    assert choose_num_splits(2, 2, 1, 4, 1, 4096) > 1
    assert choose_num_splits(2, 2, 1, 4, 1, 1024) == 1  # short context
    assert choose_num_splits(256, 256, 8, 4, 1, 32768) == 1  # enough programs already
    q, kc, vc, cu, sl, bt = make_case([1, 1], [2100, 700], 4, 1, 64, 64, dtype, seed=3)
    want = reference(q, kc, vc, cu, sl, bt, 0.125)
    q, kc, vc, cu, sl, bt = to_dev(q, kc, vc, cu, sl, bt)
    for splits in (None, 1):
        check(
            unified_attention(q, kc, vc, cu, sl, bt, 0.125, num_splits=splits),
            want,
            dtype,
            f"wrapper num_splits={splits}",
        )

    from orcaserve.kernels.pytorch import attention as ref

    q, kc, vc, cu, sl, bt = make_case([1, 12, 0], [50, 12, 3], 8, 2, 80, 16, dtype, seed=4)
    be = get_backend("triton")
    assert be.name == "triton"
    key, value = torch.randn(2, q.shape[0], 2, 80).to(dtype)
    # This step's tokens: request 0 decodes position 49, request 1 prefills positions 0..11.
    slots = [int(bt[0, 49 // 16]) * 16 + 49 % 16] + [int(bt[1, p // 16]) * 16 + p % 16 for p in range(12)]
    slots = torch.tensor(slots, dtype=torch.int64)
    k_ref, v_ref = kc.clone(), vc.clone()
    k_tri, v_tri = to_dev(kc.clone(), vc.clone())
    ref.store_kv(key, value, k_ref, v_ref, slots)
    be.store_kv(*to_dev(key, value), k_tri, v_tri, *to_dev(slots))
    assert torch.equal(k_ref.nan_to_num(7.0), k_tri.cpu().nan_to_num(7.0))
    assert torch.equal(v_ref.nan_to_num(7.0), v_tri.cpu().nan_to_num(7.0))
    plan = be.plan(*to_dev(cu, sl, bt), 16, 12, 50)
    out = be.attend(plan, *to_dev(q), k_tri, v_tri, 80**-0.5)
    assert plan.num_splits == 1
    check(out, reference(q, k_ref, v_ref, cu, sl, bt, 80**-0.5), dtype, "backend")


def section_configs(dtype):
    """GPU only: every case through the tiles the engine launches (`select_config`), unified and
    split-K, and the public wrapper with its own heuristic."""
    from orcaserve.kernels.triton.attention import launch_unified, select_config, unified_attention
    from orcaserve.kernels.triton.split_k import launch_split_k

    for i, (name, q_lens, ctx, h, h_kv, d, bs) in enumerate(_cases()):
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=5)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        q, kc, vc, cu, sl, bt = to_dev(q, kc, vc, cu, sl, bt)
        cfg = select_config(max(q_lens), h // h_kv, dtype)
        what = f"{name} H{h}/{h_kv} D{d} bs{bs} {cfg}"
        check(
            launch_unified(q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")), **cfg),
            want,
            dtype,
            f"unified {what}",
        )
        splits = (2, 3, 7)[i % 3]
        check(
            launch_split_k(q, kc, vc, cu, sl, bt, scale, torch.full_like(q, float("nan")), splits, **cfg),
            want,
            dtype,
            f"split-K({splits}) {what}",
        )
        check(unified_attention(q, kc, vc, cu, sl, bt, scale), want, dtype, f"wrapper {what}")


# GPU only, model-like steps: (name, new tokens, contexts, H, H_kv, D, block size).
LARGE = [
    ("decode_b8_long", [1] * 8, [5000, 4100, 2049, 2048, 777, 64, 1, 3000], 32, 8, 128, 16),
    ("mixed_chunk", [1] * 6 + [512, 300], [1500, 2500, 4000, 33, 1, 900, 1500, 300], 32, 8, 128, 16),
    ("mqa_g32_decode", [1, 1, 1], [3000, 2200, 17], 32, 1, 128, 32),
    ("mha_d80_prefill", [700, 1, 129], [700, 2600, 1000], 8, 8, 80, 16),
    ("smollm2_g3_d64", [1] * 5 + [200], [2500, 1200, 4096, 17, 64, 600], 9, 3, 64, 16),
    ("gqa_d96_bs64", [1, 1, 64], [3333, 100, 2000], 16, 4, 96, 64),
]


def section_large(dtype):
    """GPU only: model-like heads and contexts through the wrapper (heuristic) and forced splits."""
    from orcaserve.kernels.triton.attention import choose_num_splits, num_sms, unified_attention

    for j, (name, q_lens, ctx, h, h_kv, d, bs) in enumerate(LARGE):
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=10 + j)
        scale = d**-0.5
        want = reference(q, kc, vc, cu, sl, bt, scale)
        q, kc, vc, cu, sl, bt = to_dev(q, kc, vc, cu, sl, bt)
        auto = choose_num_splits(q.shape[0], len(ctx), h_kv, h // h_kv, max(q_lens), max(ctx), num_sms(q.device), dtype)
        for splits in (None, 1, 4, 64):
            out = unified_attention(
                q,
                kc,
                vc,
                cu,
                sl,
                bt,
                scale,
                torch.full_like(q, float("nan")),
                max_seqlen_q=max(q_lens),
                max_seqlen_k=max(ctx),
                num_splits=splits,
            )
            check(out, want, dtype, f"large {name} num_splits={splits} (heuristic {auto})")


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
if DEVICE != "cpu":  # what the interpreter cannot check (it computes bf16 wrongly) or is too slow for
    SECTIONS.update(
        {
            "unified_bf16": lambda: section_unified(torch.bfloat16),
            "split_bf16": lambda: section_split(torch.bfloat16),
            "store_bf16": lambda: section_store(torch.bfloat16),
            "dispatch_bf16": lambda: section_dispatch(torch.bfloat16),
            "configs_fp32": lambda: section_configs(torch.float32),
            "configs_fp16": lambda: section_configs(torch.float16),
            "configs_bf16": lambda: section_configs(torch.bfloat16),
            "large_fp16": lambda: section_large(torch.float16),
            "large_bf16": lambda: section_large(torch.bfloat16),
            "large_fp32": lambda: section_large(torch.float32),
        }
    )


@pytest.mark.parametrize("section", list(SECTIONS))
def test_kernel_section(section):
    # Run as a script, this file finds the shared helpers (attention_cases.py) one folder up.
    helpers = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(filter(None, [helpers, os.environ.get("PYTHONPATH")])),
    )
    if DEVICE != "cpu":
        if not (DEVICE.startswith("cuda") and torch.cuda.is_available()):
            pytest.skip(f"ORCASERVE_TEST_DEVICE={DEVICE} but torch sees no CUDA device")
        env.pop("TRITON_INTERPRET")  # compiled kernels
    proc = subprocess.run([sys.executable, __file__, section], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    import time

    from orcaserve.kernels.triton import attention as triton_attention

    compiled = isinstance(triton_attention._unified_attention_kernel, __import__("triton").runtime.jit.JITFunction)
    if DEVICE == "cpu":
        assert not compiled, "interpreter not active"
    else:
        assert compiled, f"ORCASERVE_TEST_DEVICE={DEVICE} needs compiled kernels: unset TRITON_INTERPRET"
    t0 = time.perf_counter()
    SECTIONS[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok in {time.perf_counter() - t0:.1f} s")

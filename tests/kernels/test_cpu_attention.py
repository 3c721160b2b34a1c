"""The C++ CPU paged attention (`torch.ops.orcaserve.paged_attention.<variant>`, every ISA variant this
machine executes) against the PyTorch reference.

Same kinds of cases as test_triton_kernels.py: decodes, prefills, chunked prefill with history,
mixed ragged steps, GQA ratios 1-4, block sizes 8/16/32, head dims 64/80/96/128, every slot a
request does not own poisoned with NaN, output pre-filled with NaN. Skipped if the operator cannot
be built (no compiler): the engine then falls back to the PyTorch path.
"""

import logging
import shutil
import subprocess

import pytest
import torch
from attention_cases import SCENARIOS as SHARED
from attention_cases import make_case
from cpu_variants import LOADED, REASON, op, params

from orcaserve.kernels import dispatch
from orcaserve.kernels.cpu import attention as ca
from orcaserve.kernels.cpu import build
from orcaserve.kernels.pytorch import attention as ref

if not LOADED:
    pytest.skip(f"C++ CPU attention not built: {REASON}", allow_module_level=True)
VARIANTS = params("paged_attention")

HEADS = [(4, 4), (8, 4), (9, 3), (8, 2)]  # (H, H_kv): GQA ratios 1, 2, 3, 4
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [8, 16, 32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}

# The shared cases plus two that cross several query tiles.
SCENARIOS = SHARED + [
    ("pure_prefill_3", lambda bs: ([37, 16, 2], [37, 16, 2])),
    ("chunked_prefill_history", lambda bs: ([2, 30, 130], [50, 77, 200])),
    ("mixed_ragged", lambda bs: ([1, 20, 1, 7, 0, 1], [70, 45, 3, 47, 9, 300])),
]


def want(q, kc, vc, cu, sl, bt, scale):
    f = torch.float32
    return ref.unified_attention(q.to(f), kc.to(f), vc.to(f), cu, sl, bt, scale)


def run_op(variant, q, kc, vc, cu, sl, bt, scale):
    out = torch.full_like(q, float("nan"))
    op("paged_attention", variant)(q, kc, vc, cu, sl, bt, scale, out)
    return out


def check(out, expected, dtype, what):
    assert not out.isnan().any(), f"{what}: NaN in output"
    err = (out.float() - expected).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[dtype], f"{what}: max abs error {err:.3g} > {TOL[dtype]}"


def _cases():
    """Every scenario under every block size, rotating head layouts and head dims."""
    k = 0
    for name, fn in SCENARIOS:
        for bs in BLOCK_SIZES:
            h, h_kv = HEADS[k % len(HEADS)]
            d = HEAD_DIMS[k % len(HEAD_DIMS)]
            k += 1
            yield f"{name}-H{h}/{h_kv}-D{d}-bs{bs}", *fn(bs), h, h_kv, d, bs
    for j, (h, h_kv) in enumerate(HEADS):  # every head layout x head dim on a mixed step
        for d in HEAD_DIMS:
            yield f"mix-H{h}/{h_kv}-D{d}", [1, 9, 0, 1, 3], [40, 30, 4, 17, 3], h, h_kv, d, BLOCK_SIZES[j % 3]


CASES = list(_cases())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(dtype, variant):
    for i, (name, q_lens, ctx, h, h_kv, d, bs) in enumerate(CASES):
        q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, h, h_kv, d, bs, dtype, seed=i)
        check(run_op(variant, q, kc, vc, cu, sl, bt, d**-0.5), want(q, kc, vc, cu, sl, bt, d**-0.5), dtype, name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (16, 1)])
def test_a_few_queries_answer_as_decodes_of_each(heads, variant):
    """A request with up to 17 new tokens (a verifying row: 1 + K) gives each query bit for bit the
    answer a decode of that query alone gives (docs/speculative-decoding.md, "Exactness"): the
    same kernel and the same order of sums, whatever the GQA ratio (G = 16 takes the tile kernel
    for a decode too) and across 256-key segments."""
    h, h_kv = heads
    for dtype in (torch.float32, torch.bfloat16):
        for n, ctx in ((2, 40), (5, 300), (9, 257), (17, 61)):
            q, kc, vc, cu, sl, bt = make_case([n], [ctx], h, h_kv, 64, 16, dtype, seed=n)
            many = run_op(variant, q, kc, vc, cu, sl, bt, 0.125)
            for i in range(n):
                one = run_op(
                    variant,
                    q[i : i + 1].clone(),
                    kc,
                    vc,
                    torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([ctx - n + i + 1], dtype=torch.int32),
                    bt,
                    0.125,
                )
                assert torch.equal(one[0], many[i]), (dtype, n, ctx, i)


@pytest.mark.parametrize("variant", VARIANTS)
def test_large_step_parallel_and_deterministic(variant):
    """A step big enough to run on all threads (one long prefill split into query tiles plus 31
    decodes), bitwise identical with one thread: every item is computed by one thread."""
    q_lens, ctx = [300] + [1] * 31, [340] + [50 + 17 * i for i in range(31)]
    q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, 9, 3, 64, 16, torch.float32, seed=7)
    out = run_op(variant, q, kc, vc, cu, sl, bt, 0.125)
    check(out, want(q, kc, vc, cu, sl, bt, 0.125), torch.float32, "large step")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run_op(variant, q, kc, vc, cu, sl, bt, 0.125), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (32, 2)], ids=["G3", "G16"])
def test_many_decodes_long_contexts(dtype, heads, variant):
    """Enough decodes for whole-request items (all KV heads), contexts over several 256-key
    softmax segments with odd tails, a two-token chunk; with 16 query heads per KV head a
    decode's rows go to the prefill kernel, which works one KV head at a time."""
    q_lens, ctx = [1] * 12 + [2], [1 + 97 * i for i in range(12)] + [600]
    q, kc, vc, cu, sl, bt = make_case(q_lens, ctx, *heads, 64, 16, dtype, seed=11)
    check(run_op(variant, q, kc, vc, cu, sl, bt, 0.125), want(q, kc, vc, cu, sl, bt, 0.125), dtype, f"{heads}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_query_and_empty_step(variant):
    """q as the model runner passes it (a transposed view, head dim contiguous); an empty step."""
    q, kc, vc, cu, sl, bt = make_case([1, 5], [20, 5], 8, 2, 64, 16, torch.float32, seed=3)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with stride(0) == D
    assert not q_view.is_contiguous()
    check(
        run_op(variant, q_view, kc, vc, cu, sl, bt, 0.125), want(q, kc, vc, cu, sl, bt, 0.125), torch.float32, "strided"
    )
    empty = torch.empty(0, 8, 64)
    op("paged_attention", variant)(
        empty,
        kc,
        vc,
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, 1, dtype=torch.int32),
        0.125,
        empty,
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_rejects_bad_tables(variant):
    q, kc, vc, cu, sl, bt = make_case([1], [20], 4, 2, 64, 16, torch.float32)
    bt[0, 1] = kc.shape[0]  # a block id past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        run_op(variant, q, kc, vc, cu, sl, bt, 0.125)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fake_registration_for_compile(variant):
    q, kc, vc, cu, sl, bt = make_case([1, 4], [9, 4], 4, 2, 64, 8, torch.float32)
    out = torch.empty_like(q)
    torch.library.opcheck(
        op("paged_attention", variant),
        (q, kc, vc, cu, sl, bt, 0.125, out),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_backend_store_and_attend():
    """The "cpu" backend against the reference path: store this step's K/V, then attend."""
    be = ca.make_cpu_backend()
    assert be.name == "cpu"
    q, kc, vc, cu, sl, bt = make_case([1, 12, 0], [50, 12, 3], 8, 2, 80, 16, torch.bfloat16, seed=4)
    key, value = torch.randn(2, q.shape[0], 2, 80).to(torch.bfloat16)
    # Request 0 decodes position 49, request 1 prefills positions 0..11.
    slots = [int(bt[0, 49 // 16]) * 16 + 49 % 16] + [int(bt[1, p // 16]) * 16 + p % 16 for p in range(12)]
    slots = torch.tensor(slots, dtype=torch.int64)
    be.store_kv(key, value, kc, vc, slots)
    plan = be.plan(cu, sl, bt.long(), 16, 12, 50)  # the plan converts metadata to int32
    check(be.attend(plan, q, kc, vc, 80**-0.5), want(q, kc, vc, cu, sl, bt, 80**-0.5), torch.bfloat16, "backend")
    out = torch.empty_like(q)
    assert be.attend(plan, q, kc, vc, 80**-0.5, out) is out


def test_backend_falls_back_loudly(monkeypatch, caplog):
    monkeypatch.setattr(ca.build, "load", lambda build=True: (False, "no compiler"))
    with caplog.at_level(logging.WARNING):
        be = ca.make_cpu_backend()
    assert be.name == "torch"
    assert any("no compiler" in r.getMessage() for r in caplog.records)


def test_build_is_not_triggered_on_import_or_without_build(tmp_path, monkeypatch):
    """load(build=False) never compiles: with an empty cache directory it reports why."""
    monkeypatch.setenv("ORCASERVE_EXTENSIONS_DIR", str(tmp_path))
    ok, reason = build._load(build=False, verbose=False)
    assert not ok and "not built" in reason
    assert not any(tmp_path.iterdir())


def test_backend_uncompiled_head_dim_uses_pytorch_path(caplog):
    """A head dim without a template instance goes through the PyTorch path, with one warning."""
    be = ca.make_cpu_backend()
    q, kc, vc, cu, sl, bt = make_case([1, 3], [20, 3], 4, 2, 48, 16, torch.float32, seed=5)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)  # the engine's caches are finite
    plan = be.plan(cu, sl, bt, 16, 3, 20)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            got = be.attend(plan, q, kc, vc, 48**-0.5)
    assert sum("head dim 48" in r.getMessage() for r in caplog.records) == 1
    check(got, want(q, kc, vc, cu, sl, bt, 48**-0.5), torch.float32, "fallback D48")


def test_backend_runs_the_dispatch_tables_variant():
    """The backend calls, per cache dtype, the variant kernels/dispatch.py picks for this CPU."""
    be = ca.make_cpu_backend()
    assert isinstance(be, ca.CpuBackend)
    for dtype in (torch.float32, torch.bfloat16):
        want_kernel = dispatch.resolve("paged_attention", dtype)
        assert be.op_for(dtype) is op("paged_attention", want_kernel.rsplit(".", 1)[1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("variant", [v for v in build.VARIANTS if v not in build.machine_variants()])
def test_sources_compile_for_every_variant(variant):
    """The library holds the variants the building CPU executes (compiled, and run by the tests
    above), so a CPU of another kind builds variants this one never builds: check that each of
    their sources compiles."""
    for src in build.VARIANTS[variant].sources:
        cmd = ["c++", "-fsyntax-only", *build.common_flags(), *build.variant_flags(variant), str(build.CSRC / src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{src} for {variant}:\n{done.stderr[-3000:]}"

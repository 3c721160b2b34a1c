"""The fused Triton kernels (kernels/triton/fused.py) against their PyTorch twins
(kernels/pytorch/fused.py), run by Triton's CPU interpreter (or compiled on a GPU), and the lean
decoder running them.

TRITON_INTERPRET=1 only takes effect if it is set before the kernels are defined, and another test
module may already have defined them compiled, so the sections run in a child process
(`python tests/kernels/test_triton_fused.py RESULTS_JSON SECTION...`) with the variable set. One child runs
every section (one start-up, ~10 s on 2 cores in all) and writes each section's outcome to a JSON
file; each test reads its own. bf16 is computed wrongly by the interpreter: fp32 and fp16 here.

What each kernel must match (its module docstring says why): the residual sum and the rotary
embedding with its K/V writes bit for bit; the norm and SiLU within about one ulp of the dtype.

ORCASERVE_TEST_DEVICE=cuda runs the same sections compiled on the GPU (kernel and twin on the same
GPU), plus bf16 and model-sized shapes (SmolLM2's and Llama-3.1-8B's widths, hundreds of rows).
"""

import os

DEVICE = os.environ.get("ORCASERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Relative tolerance of the norm and SiLU outputs against the twin: a few fp32 ulp (sum order, the
# GPU's rsqrt and exp), two ulp of the half types (the value rounded before the last product may
# differ by one ulp).
RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}

# (rows, hidden): one row, the SmolLM2 and Qwen2-0.5B widths (576, 896, 960: not powers of two), a
# tiny odd width, a row count past 32 and Llama's 4096.
NORM_CASES = [(1, 576), (7, 960), (33, 64), (3, 4096), (5, 100), (2, 896)]
# (rows, I, BLOCK override): SmolLM2's 1536 in one program, widths that leave a partial block, one
# row spread over 3 column blocks (5000 > 2048 per program) and small blocks forced.
SILU_CASES = [(1, 1536, None), (5, 960, None), (17, 576, None), (2, 5000, None), (3, 960, 256)]
# (H, H_kv, D, T, block size): SmolLM2's 9/3/64 GQA, padded head dims 80 and 96, MQA, MHA and
# Llama-8B's 32/8/128; T odd but one, and a single token.
ROPE_CASES = [(9, 3, 64, 13, 16), (8, 2, 80, 1, 32), (4, 1, 96, 7, 16), (4, 4, 128, 6, 64), (32, 8, 128, 3, 16)]
LARGE = dict(  # GPU only: model-sized steps
    norm=[(256, 576), (300, 4096), (4096, 4096)],
    silu=[(256, 1536, None), (300, 14336, None), (4096, 14336, None)],
    rope=[(9, 3, 64, 256, 16), (32, 8, 128, 300, 16), (32, 8, 128, 4096, 16)],
)


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any(), f"{what}: NaN"
    err = ((got - want).abs() - RTOL[dtype] * want.abs()).max().item() if got.numel() else 0.0
    assert err <= 1e-6, f"{what}: |got - want| exceeds {RTOL[dtype]:.3g} |want| + 1e-6 by {err:.3g}"


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    bad = (got.nan_to_num(7.0) != want.nan_to_num(7.0)).sum().item()  # NaN: slots never written
    assert bad == 0, f"{what}: {bad} of {got.numel()} values differ"


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def section_norm(dtype: torch.dtype, cases=NORM_CASES) -> None:
    from orcaserve.kernels.pytorch import fused as ref
    from orcaserve.kernels.triton import fused

    for i, (rows, hidden) in enumerate(cases):
        x, delta = rand(rows, hidden, dtype=dtype, seed=i), rand(rows, hidden, dtype=dtype, seed=100 + i) * 3
        weight = rand(hidden, dtype=dtype, seed=200 + i)
        eps = (1e-5, 1e-6)[i % 2]
        what = f"add_rms_norm {rows}x{hidden} {dtype}"
        s, y = fused.add_rms_norm(x, delta, weight, eps)
        s_ref, y_ref = ref.add_rms_norm(x, delta, weight, eps)
        check_equal(s, s_ref, f"{what} sum")
        check_close(y, y_ref, dtype, f"{what} norm")
        # No delta, and rows with a stride wider than hidden (a view): the norm alone, x returned.
        wide = rand(rows, hidden + 24, dtype=dtype, seed=300 + i)[:, 8 : 8 + hidden]
        s, y = fused.add_rms_norm(wide, None, weight, eps)
        assert s is wide
        check_close(y, ref.rms_norm(wide, weight, eps), dtype, f"{what} no delta, strided")
    s, y = fused.add_rms_norm(x[:0], delta[:0], weight, 1e-5)
    assert s.shape == y.shape == (0, hidden)
    for bad in (
        lambda: fused.add_rms_norm(x, delta[:, 1:], weight, 1e-5),
        lambda: fused.add_rms_norm(x, None, weight[1:], 1e-5),
    ):
        with pytest.raises(ValueError):
            bad()


def section_silu(dtype: torch.dtype, cases=SILU_CASES) -> None:
    from orcaserve.kernels.pytorch import fused as ref
    from orcaserve.kernels.triton import fused

    for i, (rows, inter, block) in enumerate(cases):
        gate_up = rand(rows, 2 * inter, dtype=dtype, seed=i) * 4  # gates out to where silu saturates
        got = fused.silu_mul(gate_up) if block is None else fused.silu_mul(gate_up, block)
        check_close(got, ref.silu_mul(gate_up), dtype, f"silu_mul {rows}x{inter} block {block} {dtype}")
    wide = rand(3, 2 * 960 + 16, dtype=dtype, seed=50)[:, 16:]  # row stride != 2 I
    check_close(fused.silu_mul(wide), ref.silu_mul(wide), dtype, "silu_mul strided")
    assert fused.silu_mul(wide[:0]).shape == (0, 960)
    with pytest.raises(ValueError):
        fused.silu_mul(wide[:, 1:])


def section_rope(dtype: torch.dtype, cases=ROPE_CASES) -> None:
    from orcaserve.kernels.pytorch import fused as ref
    from orcaserve.kernels.triton import fused

    for i, (h, hk, d, t, bs) in enumerate(cases):
        qkv = rand(t, (h + 2 * hk) * d, dtype=dtype, seed=i)
        cos, sin = rand(t, d, dtype=dtype, seed=100 + i), rand(t, d, dtype=dtype, seed=200 + i)
        num_blocks = t // bs + 3
        g = torch.Generator().manual_seed(300 + i)
        slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(torch.int64)
        slots[1::3] = -1  # padding rows: computed for q, stored nowhere
        if i == 3:
            slots[:] = -1
        slots = slots.to(DEVICE)
        for cache_dtype in (dtype, torch.float32):
            what = f"rope_store_kv H{h}/{hk} D{d} T{t} bs{bs} {dtype} cache {cache_dtype}"
            shape = (num_blocks, bs, hk, d)
            k1 = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
            v1 = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
            k2, v2 = k1.clone(), v1.clone()
            q = fused.rope_store_kv(qkv, cos, sin, k1, v1, slots, h, hk)
            q_ref = ref.rope_store_kv(qkv, cos, sin, k2, v2, slots, h, hk)
            check_equal(q, q_ref, f"{what} q")
            check_equal(k1, k2, f"{what} k cache")
            check_equal(v1, v2, f"{what} v cache")
    assert fused.rope_store_kv(qkv[:0], cos[:0], sin[:0], k1, v1, slots[:0], h, hk).shape == (0, h, d)
    for bad in (
        lambda: fused.rope_store_kv(
            qkv, cos.float() if dtype != torch.float32 else cos.half(), sin, k1, v1, slots, h, hk
        ),
        lambda: fused.rope_store_kv(qkv, cos, sin, k1, v1, slots.int(), h, hk),
        lambda: fused.rope_store_kv(qkv, cos, sin, k1, v1, slots, h + 1, hk),
    ):
        with pytest.raises(ValueError):
            bad()


def section_decoder(dtype: torch.dtype) -> None:
    """The lean decoder with triton_fused=True (forced on the CPU: the interpreter runs it) against
    the same weights through the separate PyTorch ops: a prefill step of two requests, then a
    decode step, each kernel called where the PyTorch ops would be."""
    from types import SimpleNamespace

    from orcaserve.bench.models.tiny import tiny_model
    from orcaserve.kernels import get_backend
    from orcaserve.kernels.triton import fused
    from orcaserve.scheduler.model.decoder import Decoder

    calls = {"add_rms_norm": 0, "silu_mul": 0, "rope_store_kv": 0}

    def counted(name):
        def call(*args):
            calls[name] += 1
            return getattr(fused, name)(*args)

        return call

    tri = Decoder(tiny_model("llama").to(dtype).to(DEVICE), triton_fused=True)
    assert tri.triton_ops is fused
    tri.triton_ops = SimpleNamespace(**{name: counted(name) for name in calls})  # type: ignore[assignment]
    plain = Decoder(tiny_model("llama").to(dtype).to(DEVICE), fused=False, rope_store=False, triton_fused=False)
    assert plain.triton_ops is None and not plain.fused and not plain.rope_store
    layers, hk, d, bs = len(plain.layers), plain.num_kv_heads, plain.head_dim, 16
    backend = get_backend("triton" if DEVICE != "cpu" else "torch")
    caches = {
        name: [tuple(torch.zeros(4, bs, hk, d, dtype=dtype, device=DEVICE) for _ in range(2)) for _ in range(layers)]
        for name in ("tri", "plain")
    }
    i32 = dict(dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[0, 1], [2, 3]], **i32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (19, 5)]
    steps = [  # (tokens, positions, cu_seqlens_q, seq_lens, sample rows)
        (torch.cat(prompts), torch.cat([torch.arange(19), torch.arange(5)]), [0, 19, 24], [19, 5], [18, 23]),
        (torch.tensor([7, 9]), torch.tensor([19, 5]), [0, 1, 2], [20, 6], [0, 1]),
    ]
    for n, (tokens, pos, cu, seq_lens, rows) in enumerate(steps):
        req = torch.repeat_interleave(torch.arange(2), torch.tensor(cu).diff())
        slots = (tables.cpu()[req, pos // bs].long() * bs + pos % bs).to(DEVICE)
        max_q = max(b - a for a, b in zip(cu, cu[1:]))
        plan = backend.plan(torch.tensor(cu, **i32), torch.tensor(seq_lens, **i32), tables, bs, max_q, max(seq_lens))
        args = (tokens.to(DEVICE), pos.to(DEVICE), torch.tensor(rows, device=DEVICE), backend, plan, slots)
        got = tri.forward(*args, caches["tri"])
        want = plain.forward(*args, caches["plain"])
        # bf16 (GPU only): last-bit differences of the norm grow through the layers; greedy ties possible.
        tol = 1e-4 if dtype == torch.float32 else 1e-1
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=n: f"step {n} logits: {m}")
        if dtype == torch.float32:
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {n}: greedy tokens differ"
        for (k1, v1), (k2, v2) in zip(caches["tri"], caches["plain"]):
            torch.testing.assert_close(k1, k2, atol=tol, rtol=tol)
            torch.testing.assert_close(v1, v2, atol=tol, rtol=tol)
    assert calls == {"add_rms_norm": 2 * (2 * layers + 1), "silu_mul": 2 * layers, "rope_store_kv": 2 * layers}, calls


def section_bench_smoke() -> None:
    """`orcaserve-bench gpu fused` (the GPU check's step, benchmarks/gpu/fused.py) end to end at its
    smoke sizes."""
    import tempfile

    from orcaserve.bench import cli

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu-fused.json"
        assert cli.main(["gpu", "fused", "--smoke", "--out", str(out)]) == 0
        res = json.loads(out.read_text())
    assert res["all_ok"] and {r["op"] for r in res["rows"]} == {"add_rms_norm", "silu_mul", "rope_store_kv"}
    assert all(r["triton"]["eager_us"] > 0 and r["torch"]["eager_us"] > 0 for r in res["rows"])


f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
SECTION_FNS = {"norm": section_norm, "silu": section_silu, "rope": section_rope}
SECTIONS = {
    "norm_fp32": lambda: section_norm(f32),
    "norm_fp16": lambda: section_norm(f16),
    "silu_fp32": lambda: section_silu(f32),
    "silu_fp16": lambda: section_silu(f16),
    "rope_fp32": lambda: section_rope(f32),
    "rope_fp16": lambda: section_rope(f16),
    "decoder_fp32": lambda: section_decoder(f32),
    "bench_smoke": section_bench_smoke,
}
if DEVICE != "cpu":  # what the interpreter cannot check (bf16) or is too slow for
    SECTIONS.update(
        {
            "norm_bf16": lambda: section_norm(bf16),
            "silu_bf16": lambda: section_silu(bf16),
            "rope_bf16": lambda: section_rope(bf16),
            "decoder_bf16": lambda: section_decoder(bf16),
            **{
                f"{op}_large_{n}": (lambda op=op, dt=dt: SECTION_FNS[op](dt, LARGE[op]))
                for op in LARGE
                for n, dt in (("fp32", f32), ("bf16", bf16))
            },
        }
    )
    del SECTIONS["bench_smoke"]  # the GPU check runs the benchmark itself


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Every section in one child process: {section: None (passed) or its traceback}."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if DEVICE != "cpu":
        if not (DEVICE.startswith("cuda") and torch.cuda.is_available()):
            pytest.skip(f"ORCASERVE_TEST_DEVICE={DEVICE} but torch sees no CUDA device")
        env.pop("TRITON_INTERPRET")  # compiled kernels
    out = tmp_path_factory.mktemp("fused") / "outcomes.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out), *SECTIONS], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("section", list(SECTIONS))
def test_fused_section(section, outcomes):
    assert section in outcomes, f"{section} did not run"
    assert outcomes[section] is None, outcomes[section]


def test_decoder_uses_triton_only_on_cuda_by_default():
    """Without an override the Triton kernels are chosen for CUDA models only: a CPU model keeps
    its C++ or PyTorch ops (nothing here imports the kernels)."""
    from orcaserve.kernels.triton import fused_ops as triton_fused_ops

    assert triton_fused_ops(None, cuda=False) is None
    assert triton_fused_ops(False, cuda=True) is None


if __name__ == "__main__":
    import time

    from orcaserve.kernels.triton import fused as triton_fused

    compiled = isinstance(triton_fused._rope_store_kv_kernel, __import__("triton").runtime.jit.JITFunction)
    assert compiled == (DEVICE != "cpu"), "interpreter not active" if DEVICE == "cpu" else "unset TRITON_INTERPRET"
    results: dict[str, str | None] = {}
    for name in sys.argv[2:]:
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
            results[name] = None
            print(f"{name}: ok in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - every failure is reported to its test
            results[name] = traceback.format_exc()
            print(f"{name}: FAILED in {time.perf_counter() - t0:.1f} s\n{results[name]}", flush=True)
        Path(sys.argv[1]).write_text(json.dumps(results))

"""Compile every Triton kernel configuration for sm_80 and sm_90 without a GPU.

    python -m orcaserve.kernels.triton.compile_check            # full matrix, table on stdout
    python -m orcaserve.kernels.triton.compile_check --quick    # one representative row per kernel/target
    python -m orcaserve.kernels.triton.compile_check --jobs 4 --arch 90

Each kernel x dtype (fp32/fp16/bf16) x head dim (64/80/96/128) x tile configuration (the ones
`attention.select_config` and the store/reduce launchers use) is built with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`, which runs Triton's
bundled ptxas. Registers and spill bytes come from the `ptxas -v` log (TRITON_DUMP_PTXAS_LOG;
CompiledKernel only learns n_regs/n_spills when a driver loads the binary), shared memory from
`metadata.shared`. Exit status 1 on any compile error, so CI fails; spills are reported, not
failed, because they cost speed, not correctness.

The decoder's fused kernels (fused.py) are built the same way: the rotary + K/V store per head dim
for SmolLM2's (9/3) and Llama-8B's (32/8) head counts; the residual add + RMSNorm and SiLU * up,
which have no head dim ("-" in the table), at the block sizes of the widths 576 and 4096 and
of intermediate sizes up to 1024 and above.

The interpreter (TRITON_INTERPRET=1) would skip codegen entirely, so `main` removes it from the
environment before Triton is imported; if Triton kernels were already defined in interpreted mode
in this process, the check re-runs itself in a clean subprocess. Importing the module has no
effect on the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
HEAD_DIMS = (64, 80, 96, 128)
ARCHS = (80, 90)
KERNELS = (
    "unified", "split_k", "reduce", "store_kv", "add_rms_norm", "silu_mul", "rope_store_kv", "ternary",
    "lora_shrink", "lora_expand",
)  # fmt: skip
FLAT = ("add_rms_norm", "silu_mul", "ternary", "lora_shrink", "lora_expand")  # no head dim: built once
# Pointers of another type than the configuration's dtype: the ternary GEMM's integers, the LoRA
# kernels' segments and fp32 intermediate.
_SEGMENTS = {"order_ptr": "*i32", "starts_ptr": "*i32", "slot_ptr": "*i32", "h_ptr": "*fp32"}
POINTERS = {
    "ternary": {"x_ptr": "*i8", "w_ptr": "*u8", "out_ptr": "*i32"},
    "lora_shrink": _SEGMENTS,
    "lora_expand": {**_SEGMENTS, "scale_ptr": "*fp32"},
}
INTEGER = ("ternary",)  # the table's dtype column reads int8
# --quick: the one configuration (by label) built per fused kernel (bf16; the rotary at head dim 80)
QUICK_FUSED = {
    "add_rms_norm": "h4096", "silu_mul": "I>1024", "rope_store_kv": "H9/3", "ternary": "M",
    "lora_shrink": "r16", "lora_expand": "r16",
}  # fmt: skip


def _configs() -> list[tuple[str, str, dict, dict, str]]:
    """(kernel, label, constexprs without head dim, launch options, dtype) as the launchers use."""
    import torch
    import triton

    from orcaserve.kernels.triton import lora, ternary
    from orcaserve.kernels.triton.attention import select_config
    from orcaserve.kernels.triton.fused import SILU_BLOCK, _num_warps
    from orcaserve.kernels.triton.store_kv import BLOCK_T

    p2 = triton.next_power_of_2

    out = []
    for dtype in DTYPES:
        for label, max_q in (("decode", 1), ("prefill", 64)):
            cfg = select_config(max_q, 4, getattr(torch, DTYPES[dtype]))
            opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            tiles = dict(BLOCK_M=cfg["block_m"], TILE_N=cfg["tile_n"])
            name = f"{label} M{cfg['block_m']} N{cfg['tile_n']}"
            out.append(("unified", name, tiles, opts, dtype))
            out.append(("split_k", name, tiles, opts, dtype))
        out.append(("reduce", "-", {}, dict(num_warps=0), dtype))  # 0: chosen like the launcher
        out.append(("store_kv", f"T{BLOCK_T}", dict(BLOCK_T=BLOCK_T), dict(num_warps=0), dtype))
        for hidden, delta in ((576, True), (576, False), (4096, True)):
            tiles = dict(BLOCK=p2(hidden), HAS_DELTA=delta)
            label = f"h{hidden}" + ("" if delta else " no delta")
            out.append(("add_rms_norm", label, tiles, dict(num_warps=_num_warps(p2(hidden))), dtype))
        for label, block in (("I<=1024 B1024", 1024), (f"I>1024 B{SILU_BLOCK}", SILU_BLOCK)):
            out.append(("silu_mul", label, dict(BLOCK=block), dict(num_warps=_num_warps(block)), dtype))
        for h, hk in ((9, 3), (32, 8)):
            tiles = dict(HEADS_PAD=p2(h + hk), KV_PAD=p2(hk))
            opts = dict(num_warps=0, enable_fp_fusion=False)  # as the launcher
            out.append(("rope_store_kv", f"H{h}/{hk}", tiles, opts, dtype))
        for r_pad in (16, 64):  # ranks up to 16 (max_lora_rank's default), up to 64
            opts = dict(num_warps=lora.NUM_WARPS, enable_fp_fusion=False)  # as the launcher
            ieee = dtype == "fp32"
            tiles = dict(IEEE=ieee, BLOCK_M=lora.BLOCK_M, BLOCK_K=lora.BLOCK_K, R_PAD=r_pad)
            out.append(("lora_shrink", f"r{r_pad} M{lora.BLOCK_M} K{lora.BLOCK_K}", tiles, opts, dtype))
            tiles = dict(IEEE=ieee, BLOCK_M=lora.BLOCK_M, BLOCK_N=lora.BLOCK_N, R_PAD=r_pad)
            out.append(("lora_expand", f"r{r_pad} M{lora.BLOCK_M} N{lora.BLOCK_N}", tiles, opts, dtype))
    t = ternary.BLOCK_M, ternary.BLOCK_N, ternary.BLOCK_K
    tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), t))
    out.append(("ternary", "M{} N{} K{}".format(*t), tiles, dict(num_warps=4), "bf16"))  # POINTERS types it
    return out


def _kernel(name: str):
    from orcaserve.kernels.triton import attention as triton_attention
    from orcaserve.kernels.triton import fused as triton_fused
    from orcaserve.kernels.triton import lora as triton_lora
    from orcaserve.kernels.triton import split_k as triton_split_k
    from orcaserve.kernels.triton import store_kv as triton_store_kv
    from orcaserve.kernels.triton import ternary as triton_ternary

    return {
        "unified": triton_attention._unified_attention_kernel,
        "split_k": triton_split_k._split_k_kernel,
        "reduce": triton_split_k._reduce_splits_kernel,
        "store_kv": triton_store_kv._store_kv_kernel,
        "add_rms_norm": triton_fused._add_rms_norm_kernel,
        "silu_mul": triton_fused._silu_mul_kernel,
        "rope_store_kv": triton_fused._rope_store_kv_kernel,
        "ternary": triton_ternary._ternary_kernel,
        "lora_shrink": triton_lora._shrink_kernel,
        "lora_expand": triton_lora._expand_kernel,
    }[name]


def _signature(fn, dtype: str):
    """Types as the runtime would specialise them: 16-aligned pointers, strides divisible by 16
    (true for every supported head dim), unit head-dim strides turned into constants."""
    sig, attrs, consts = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n] = "constexpr"
        elif n in ("stride_kd", "stride_vd", "stride_ak", "stride_bn"):  # unit strides: constants
            sig[n] = "constexpr"
            consts[n] = 1
        elif n in ("cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr"):
            sig[n] = "*i32"
        elif n == "slot_mapping_ptr":
            sig[n] = "*i64"
        elif n.endswith("_ws_ptr"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*" + dtype
        elif n in ("scale_log2", "eps"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
        if n.endswith("_ptr") or n.startswith("stride") or n == "block_size":
            if sig[n] != "constexpr":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, consts


_LOG_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spill_st": re.compile(r"(\d+) bytes spill stores"),
    "spill_ld": re.compile(r"(\d+) bytes spill loads"),
}


def compile_one(job: tuple) -> dict:
    kernel, label, tiles, opts, dtype, head_dim, arch = job
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    fn = _kernel(kernel)
    sig, attrs, consts = _signature(fn, dtype)
    sig.update(POINTERS.get(kernel, {}))
    consts.update(tiles)
    d_pad = triton.next_power_of_2(head_dim) if head_dim else 0
    if head_dim:
        consts.update(HEAD_DIM=head_dim, D_PAD=d_pad)
    opts = dict(opts)
    if opts.get("num_warps") == 0:
        if kernel == "rope_store_kv":
            from orcaserve.kernels.triton.fused import _num_warps

            opts["num_warps"] = _num_warps(tiles["HEADS_PAD"] * d_pad)
        else:
            opts["num_warps"] = (1 if d_pad <= 64 else 2) if kernel == "reduce" else (4 if head_dim > 64 else 2)
    row = dict(
        kernel=kernel,
        config=label,
        dtype="int8" if kernel in INTEGER else dtype,
        head_dim=head_dim or "-",
        arch=f"sm_{arch}",
        warps=opts["num_warps"],
        stages=opts.get("num_stages", 3),
    )
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            c = triton.compile(
                triton.compiler.ASTSource(fn, sig, consts, attrs),
                target=GPUTarget("cuda", arch, 32),
                options=opts,
            )
    except Exception as e:  # noqa: BLE001 - every failure must end up in the table
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
        return row
    row["seconds"] = time.perf_counter() - t0
    text = log.getvalue()
    for key, rx in _LOG_RE.items():
        m = rx.search(text)
        row[key] = int(m.group(1)) if m else -1
    row["smem"] = c.metadata.shared
    return row


def _jobs(quick: bool, archs, kernels=None, dtypes=None) -> list[tuple]:
    jobs: list[tuple] = []
    for kernel, label, tiles, opts, dtype in _configs():
        if kernels and kernel not in kernels or dtypes and dtype not in dtypes:
            continue
        if quick and kernel in QUICK_FUSED and not label.startswith(QUICK_FUSED[kernel]):
            continue
        for d in (0,) if kernel in FLAT else HEAD_DIMS:
            if quick and (dtype, d or 80) not in (("bf16", 80), ("fp16", 128)):
                continue
            if quick and kernel not in ("unified", "split_k") and dtype != "bf16":
                continue
            jobs.extend((kernel, label, tiles, opts, dtype, d, arch) for arch in archs)
    return jobs


def _interpreted() -> bool:
    from triton.runtime.jit import JITFunction

    return not isinstance(_kernel("unified"), JITFunction)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="representative subset only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", type=int, action="append", choices=ARCHS, help="default: 80 and 90")
    ap.add_argument("--kernel", action="append", choices=KERNELS)
    ap.add_argument("--dtype", action="append", choices=tuple(DTYPES))
    args = ap.parse_args(argv)
    # Before Triton is imported (`_interpreted` imports the kernels). Importing this module
    # changes nothing: only running the check does.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's deprecation warning
    # A fresh cache: a cache hit would skip ptxas and leave no register report.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="orcaserve-compile-check-")
    if _interpreted():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "orcaserve.kernels.triton.compile_check", *(argv or sys.argv[1:])]
        return subprocess.call(cmd, env=env)

    jobs = _jobs(args.quick, tuple(args.arch or ARCHS), args.kernel, args.dtype)
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(compile_one, jobs))
    else:
        rows = [compile_one(j) for j in jobs]
    wall = time.perf_counter() - t0

    hdr = (
        f"{'kernel':<13} {'config':<17} {'dtype':<5} {'D':>4} {'arch':<6} {'warps':>5} "
        f"{'stages':>6} {'regs':>5} {'smem B':>7} {'spill st/ld B':>14} {'compile s':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    errors = spilled = 0
    for r in rows:
        head = (
            f"{r['kernel']:<13} {r['config']:<17} {r['dtype']:<5} {r['head_dim']:>4} {r['arch']:<6} "
            f"{r['warps']:>5} {r['stages']:>6}"
        )
        if "error" in r:
            errors += 1
            print(f"{head} COMPILE ERROR {r['error']}")
            continue
        spilled += r["spill_st"] > 0 or r["spill_ld"] > 0
        spill = f"{r['spill_st']}/{r['spill_ld']}"
        print(f"{head} {r['regs']:>5} {r['smem']:>7} {spill:>14} {r['seconds']:>9.2f}")
    print(
        f"\n{len(rows)} configurations, {errors} compile errors, {spilled} with register spills, "
        f"{wall:.1f} s wall with {args.jobs} jobs"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

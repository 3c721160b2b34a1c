"""Time the Triton attention kernels on a CUDA GPU: decode bandwidth, prefill throughput, split-K.

    orcaserve-bench gpu kernels [--dtype bf16] [--shapes 32x8x128,9x3x64] [--quick] [--time-budget S]
    orcaserve-bench gpu kernels --smoke      # CPU, TRITON_INTERPRET=1, tiny sizes: every code path

Per head layout HxH_kvxD (the first gets the full grid, the others the quick one): decode at batch
1-256 x context 1k-32k, every split count up to context/256 timed beside the one
`choose_num_splits` picks (the table the heuristic was fitted to, docs/kernels.md "Split-K
heuristic, refitted on the H200"), its bandwidth as a share of the datasheet peak and of the
measured copy bandwidth; prefill TFLOP/s beside SDPA's; ORCA's mixed steps; store_kv; the PyTorch
twin at small decode shapes (kernel_sections.py). Each timed call follows a 256 MiB write that
evicts the L2; medians of CUDA events. The JSON is rewritten after every shape, so a run cut
short (or stopped by --time-budget, which starts no new shape) keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from orcaserve.bench.cli import add_out
from orcaserve.bench.gpu_common import skip_or_interpret
from orcaserve.bench.kernel_timing import PEAK_BF16_TFLOPS, Timer, copy_gbps, lookup, peak_gbps
from orcaserve.bench.result import write

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def summarize(run: dict) -> dict:
    """Key figures of one layout: decode share of peak at contexts >= 4k, the split-K verdict."""
    dec = [r for r in run.get("decode", []) if "heuristic_ms" in r]
    long = [r for r in dec if r["context"] >= 4096 and r.get("pct_peak") is not None]
    s: dict = {"decode_shapes": len(dec)}
    if long:
        pcts = sorted(r["pct_peak"] for r in long)
        s.update(
            decode_pct_peak_ctx4k_median=statistics.median(pcts),
            decode_pct_peak_ctx4k_max=pcts[-1],
            decode_pct_peak_ctx4k_min=pcts[0],
            decode_ctx4k_shapes_at_70pct=sum(p >= 70 for p in pcts),
            decode_ctx4k_shapes=len(pcts),
        )
    if dec:
        ratios = [r["heuristic_over_best"] for r in dec]
        worst = max(dec, key=lambda r: r["heuristic_over_best"])
        s["max_diff_across_splits"] = max(r.get("max_diff_across_splits", 0.0) for r in dec)
        s.update(
            split_heuristic_within_5pct=sum(x <= 1.05 for x in ratios),
            split_heuristic_within_10pct=sum(x <= 1.10 for x in ratios),
            split_heuristic_worst_ratio=worst["heuristic_over_best"],
            split_heuristic_worst_shape=f"B={worst['batch']} ctx={worst['context']} "
            f"heuristic {worst['heuristic_splits']} best {worst['best_splits']}",
            # Where the heuristic and the measurement disagree by > 10%: the tuning input.
            split_disagreements=[
                {
                    k: r[k]
                    for k in ("batch", "context", "programs", "heuristic_splits", "best_splits", "heuristic_over_best")
                }
                for r in dec
                if r["heuristic_over_best"] > 1.10
            ],
        )
    pre = run.get("prefill", [])
    if pre:
        s["prefill_tflops_max"] = max(r["tflops"] for r in pre)
        fresh = [r for r in pre if r.get("sdpa_ms")]
        if fresh:
            s["prefill_vs_sdpa"] = {r["label"]: r["sdpa_ms"] / r["ms"] for r in fresh}
    return s


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument(
        "--shapes",
        default="32x8x128",
        help="comma list of HxH_kvxD; the first gets the full grid, the rest the quick one",
    )
    ap.add_argument("--peak-gbps", type=float, default=None, help="HBM peak (default: the datasheet's by name)")
    ap.add_argument("--quick", action="store_true", help="quick grid for every layout")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on the CPU under TRITON_INTERPRET=1, fp32")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; no new shape starts after it")
    add_out(ap, help="write results here (rewritten after every shape)")


def run(args: argparse.Namespace) -> dict:
    skipped = skip_or_interpret("kernel_bench.py", args.smoke)
    if skipped is not None:
        return skipped
    cuda = torch.cuda.is_available()
    if not cuda:
        if args.dtype != "fp32":
            print("smoke on CPU: fp32 (the interpreter computes bf16 wrongly)")
            args.dtype = "fp32"
    import triton

    from orcaserve.bench.kernel_sections import BLOCK_SIZE, bench_layout  # after TRITON_INTERPRET

    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET=1)"
    dtype = DTYPES[args.dtype]
    timer = Timer(dev)
    peak = args.peak_gbps or (peak_gbps(name) if cuda else None)
    copy_bw = copy_gbps(dev, timer)
    peak_tf = lookup(PEAK_BF16_TFLOPS, name) if cuda and dtype != torch.float32 else None
    if args.smoke and not cuda:
        layouts = [(4, 2, 64)]
    else:
        layouts = [tuple(int(x) for x in s.split("x"))[:3] for s in args.shapes.split(",")]  # type: ignore[misc]
    result = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "smoke": args.smoke,
        "peak_gbps_datasheet": peak,
        "copy_gbps_measured": copy_bw,
        "peak_tflops_datasheet": peak_tf,
        "num_sms": torch.cuda.get_device_properties(dev).multi_processor_count if cuda else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [],
    }
    print(
        f"device {name}, {args.dtype}, peak {peak or 'unknown'} GB/s (datasheet), copy "
        f"{round(copy_bw) if copy_bw else '-'} GB/s (measured), block_size {BLOCK_SIZE}"
    )

    def save():
        for one in result["runs"]:
            one["summary"] = summarize(one)
        if args.out:
            write(args.out, result)

    env = {
        "device": dev,
        "dtype": dtype,
        "timer": timer,
        "peak_gbps": peak,
        "copy_gbps": copy_bw,
        "peak_tflops": peak_tf,
        "t0": time.perf_counter(),
    }
    for i, (h, h_kv, d) in enumerate(layouts):
        one: dict = {}
        result["runs"].append(one)
        bench_layout(args, h, h_kv, d, args.quick or i > 0, env, one, save)
        if cuda:
            torch.cuda.empty_cache()
        if one.get("truncated"):
            print(f"time budget of {args.time_budget} s reached; stopping")
            break
    for one in result["runs"]:
        one["summary"] = summarize(one)
        print(
            f"\nsummary {one['heads']}x{one['kv_heads']}x{one['head_dim']}: "
            f"{json.dumps({k: v for k, v in one['summary'].items() if k != 'split_disagreements'})}"
        )
    result["elapsed_s"] = time.perf_counter() - env["t0"]
    save()
    return result

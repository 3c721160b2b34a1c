"""Time the Triton attention kernels on a CUDA GPU: decode bandwidth, prefill throughput, split-K.

    python benchmarks/kernels.py [--dtype bf16] [--shapes 32x8x128,9x3x64] [--block-size 16]
                                 [--peak-gbps 4800] [--quick] [--json out.json] [--time-budget S]
    python benchmarks/kernels.py --smoke      # CPU, TRITON_INTERPRET=1, tiny sizes: every code path

Per head layout HxH_kvxD (`--shapes`; the first gets the full grid, the others the quick one):

* decode: batch 1-256 x context 1k-32k (quick: 1/8/64/256 x 1k/4k/32k). Every split count in
  {1, 2, 4, ..., 64} (up to context/256) is timed next to the one `choose_num_splits` picks, so
  each shape gives the heuristic's time, the measured best and the ratio (data to tune
  SPLIT_MIN_CONTEXT / SPLIT_TARGET_WAVES / the programs >= SMs rule). Bandwidth counts the
  minimum bytes a step must move (each request's K and V once per KV head, plus q and out),
  as a share of the datasheet HBM peak (PEAK_GBPS by device name, or --peak-gbps) and of the
  device-to-device copy bandwidth measured at the start (a realistic ceiling).
* prefill: fresh prompts of 1k/4k/16k tokens, a batch of 8 x 2k, and a 2k chunk over a 14k
  cache; causal attention TFLOP/s (4 * H * D * visible (query, key) pairs), next to PyTorch's
  SDPA (flash) on the same fresh prompt as a yardstick.
* mixed: ORCA's merged steps (running decodes plus one prefill chunk).
* store_kv: a decode batch up to a long prefill chunk.
* the PyTorch twin (`torch_attention.TorchAttentionPlan`, the CPU engine's path) for small decode shapes.

Each timed call runs after a 256 MiB write that evicts the L2 (so small shapes are not served
from the 50-60 MB L2), between CUDA events; the median is reported. The JSON (--json) is
rewritten after every shape, so a run cut short by a timeout (or by --time-budget, which stops
starting new shapes) still leaves what was measured. Without CUDA and without --smoke it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

PEAK_GBPS = {  # HBM peak, GB/s, matched as substrings of torch.cuda.get_device_name()
    "GH200": 4000.0,
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
}
PEAK_BF16_TFLOPS = {
    "GH200": 990.0,
    "H200": 990.0,
    "H100 PCIe": 756.0,
    "H100": 990.0,
    "H800": 990.0,
    "A100": 312.0,
}  # dense, datasheet

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def lookup(table: dict, name: str) -> float | None:
    for key, val in table.items():  # insertion order puts specific names first
        if key in name:
            return val
    return None


def peak_gbps(name: str) -> float | None:
    return lookup(PEAK_GBPS, name)


class Timer:
    """Median milliseconds of `fn`: CUDA events with an L2 flush before each call, or (smoke mode,
    CPU) wall time of one call."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn, max_iters: int = 20, target_ms: float = 40.0) -> float:
        if not self.cuda:
            fn()  # warm-up (the interpreter has no compile step, but keep the shape of a run)
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        fn()  # compile + warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = (time.perf_counter() - t) * 1e3
        iters = max(3, min(max_iters, int(target_ms / max(first, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_gbps(device: torch.device, timer: Timer) -> float | None:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.int8, device=device)
    b = torch.empty_like(a)
    ms = timer(functools.partial(b.copy_, a))
    return 2 * (1 << 30) / ms / 1e6


class CachePool:
    """One K/V cache big enough for the largest step; each step gets shuffled blocks of it."""

    def __init__(self, num_blocks, bs, h_kv, d, dtype, device):
        self.bs, self.device = bs, device
        self.k = torch.randn(num_blocks, bs, h_kv, d, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)

    def step(self, q_lens, ctx, h, d, dtype):
        bs, dev = self.bs, self.device
        per_req = [max(1, -(-c // bs)) for c in ctx]
        total = sum(per_req)
        if total > self.k.shape[0]:
            raise ValueError(f"step needs {total} blocks, the pool has {self.k.shape[0]}")
        perm = torch.randperm(self.k.shape[0], device=dev)[:total].to(torch.int32)
        tables = torch.zeros(len(ctx), max(per_req), dtype=torch.int32, device=dev)
        used = 0
        for i, n in enumerate(per_req):
            tables[i, :n] = perm[used : used + n]
            used += n
        cu = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, device=dev), 0)
        seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
        q = torch.randn(int(sum(q_lens)), h, d, device=dev, dtype=dtype)
        return q, cu, seq_lens, tables


def visible_pairs(q_lens, ctx) -> int:
    """(query, key) pairs a causal step computes: new token j of a request sees ctx - n + j + 1 keys."""
    return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctx, strict=True))


def grid(quick: bool, smoke: bool):
    if smoke:
        return (1, 2), (64, 160)
    if quick:
        return (1, 8, 64, 256), (1024, 4096, 32768)
    return (1, 2, 4, 8, 16, 32, 64, 128, 256), (1024, 2048, 4096, 8192, 16384, 32768)


def bench_layout(args, h, h_kv, d, quick, ctx_env, out: dict, save) -> None:
    """Every section for one head layout; results accumulate in `out` (saved after each shape)."""
    from orcaserve.kernels import torch_attention
    from orcaserve.kernels.triton_attention import choose_num_splits, num_sms, select_config, unified_attention
    from orcaserve.kernels.triton_store_kv import store_kv

    dev, dtype, bs, timer, smoke = ctx_env["device"], ctx_env["dtype"], args.block_size, ctx_env["timer"], args.smoke
    peak, copy_bw, sms = ctx_env["peak_gbps"], ctx_env["copy_gbps"], num_sms(dev)
    esz = torch.tensor([], dtype=dtype).element_size()
    scale = d**-0.5
    batches, contexts = grid(quick, smoke)
    out.update(
        {
            "heads": h,
            "kv_heads": h_kv,
            "head_dim": d,
            "block_size": bs,
            "grid": "smoke" if smoke else ("quick" if quick else "full"),
            "decode": [],
            "prefill": [],
            "mixed": [],
            "store_kv": [],
        }
    )

    # One pool for the whole layout, sized for the largest decode step that fits in memory.
    token_bytes = 2 * h_kv * d * esz
    budget = (args.max_cache_gib * (1 << 30)) if dev.type == "cuda" else (64 << 20)
    if dev.type == "cuda":
        budget = min(budget, 0.6 * torch.cuda.mem_get_info(dev)[0])
    need = max(max(b * c for b in batches for c in contexts), 8 * 2048, 16384)
    pool_tokens = int(min(need, budget // token_bytes))
    pool = CachePool(-(-pool_tokens // bs) + len(batches) * max(batches), bs, h_kv, d, dtype, dev)
    out["pool_gib"] = round(pool.k.numel() * 2 * esz / (1 << 30), 2)

    def over_budget() -> bool:
        return args.time_budget is not None and time.perf_counter() - ctx_env["t0"] > args.time_budget

    def pct(gbps, ceiling):
        return round(100 * gbps / ceiling, 1) if ceiling else None

    # ---- decode: bandwidth and the split-K choice vs the measured best ------------------------
    print(f"\n[{h}x{h_kv}x{d}] decode (median ms per call; heur = choose_num_splits, best = fastest measured)")
    print(
        f"{'B':>4} {'ctx':>6} {'progs':>6} {'heur':>5} {'best':>5} {'heur ms':>9} {'best ms':>9} {'ratio':>6} "
        f"{'GB/s':>7} {'%peak':>6} {'%copy':>6} {'torch ms':>9}"
    )
    for c in contexts:
        for b in batches:
            if over_budget():
                out["truncated"] = True
                return
            if b * c > pool_tokens:
                out["decode"].append({"batch": b, "context": c, "skipped": "cache pool too small"})
                continue
            q_lens, ctx = [1] * b, [c] * b
            q, cu, sl, bt = pool.step(q_lens, ctx, h, d, dtype)
            heur = choose_num_splits(b, b, h_kv, h // h_kv, 1, c, sms, dtype)
            block_q = select_config(1, h // h_kv, dtype)["block_m"] // (h // h_kv)
            programs = (b // block_q + b) * h_kv
            o = torch.empty_like(q)
            max_split = 2 if smoke else c // 256  # smoke: still run the split-K kernels
            cands = sorted({s for s in (args.splits or SPLIT_CANDIDATES) if s == 1 or s <= max_split} | {heur})
            times, first, max_diff = {}, None, 0.0
            for s in cands:
                times[s] = timer(
                    functools.partial(
                        unified_attention,
                        q,
                        pool.k,
                        pool.v,
                        cu,
                        sl,
                        bt,
                        scale,
                        o,
                        max_seqlen_q=1,
                        max_seqlen_k=c,
                        num_splits=s,
                    )
                )
                if first is None:
                    first = o.to(torch.float32, copy=True)
                else:  # every split count computes the same attention
                    max_diff = max(max_diff, (o.float() - first).abs().max().item())
            best = min(times, key=times.get)
            moved = 2 * b * c * h_kv * d * esz + 2 * q.numel() * esz
            gbps = moved / times[heur] / 1e6
            ref_ms = None
            if not args.no_reference and b * c <= args.reference_max_tokens:
                try:
                    plan = torch_attention.TorchAttentionPlan(cu, sl, bt, bs)
                    ref_ms = timer(functools.partial(plan.attend, q, pool.k, pool.v, scale, o), max_iters=5)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
            row = {
                "batch": b,
                "context": c,
                "programs": programs,
                "heuristic_splits": heur,
                "best_splits": best,
                "heuristic_ms": times[heur],
                "best_ms": times[best],
                "heuristic_over_best": times[heur] / times[best],
                "ms_by_splits": {str(k): v for k, v in times.items()},
                "bytes": moved,
                "gbps": gbps,
                "pct_peak": pct(gbps, peak),
                "pct_copy": pct(gbps, copy_bw),
                "best_gbps": moved / times[best] / 1e6,
                "torch_ms": ref_ms,
                "max_diff_across_splits": max_diff,
            }
            out["decode"].append(row)
            print(
                f"{b:>4} {c:>6} {programs:>6} {heur:>5} {best:>5} {times[heur]:>9.4f} {times[best]:>9.4f} "
                f"{row['heuristic_over_best']:>6.2f} {gbps:>7.0f} {row['pct_peak'] or '-':>6} "
                f"{row['pct_copy'] or '-':>6} {ref_ms if ref_ms is None else round(ref_ms, 3)!s:>9}"
            )
            save()

    # ---- prefill: fresh prompts, a batch, a chunk over a long cache --------------------------------
    if smoke:
        prefills = [("fresh 32", [32], [32]), ("chunk 16 @ 80", [16], [80])]
    elif quick:
        prefills = [("fresh 4k", [4096], [4096]), ("chunk 2k @ 16k", [2048], [16384])]
    else:
        prefills = [
            ("fresh 1k", [1024], [1024]),
            ("fresh 4k", [4096], [4096]),
            ("fresh 16k", [16384], [16384]),
            ("batch 8 x 2k", [2048] * 8, [2048] * 8),
            ("chunk 2k @ 16k", [2048], [16384]),
        ]
    peak_tf = ctx_env["peak_tflops"]
    print(f"\n[{h}x{h_kv}x{d}] prefill")
    print(f"{'shape':<18} {'splits':>6} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'sdpa ms':>9} {'sdpa TF/s':>9}")
    for label, q_lens, ctx in prefills:
        if over_budget():
            out["truncated"] = True
            return
        q, cu, sl, bt = pool.step(q_lens, ctx, h, d, dtype)
        o = torch.empty_like(q)
        splits = choose_num_splits(q.shape[0], len(ctx), h_kv, h // h_kv, max(q_lens), max(ctx), sms, dtype)
        ms = timer(
            functools.partial(
                unified_attention,
                q,
                pool.k,
                pool.v,
                cu,
                sl,
                bt,
                scale,
                o,
                max_seqlen_q=max(q_lens),
                max_seqlen_k=max(ctx),
                num_splits=splits,
            )
        )
        flops = 4 * h * d * visible_pairs(q_lens, ctx)
        tf = flops / ms / 1e9
        sdpa_ms = None
        if len(q_lens) == 1 and q_lens == ctx:  # fresh prompt: contiguous K/V, plain causal SDPA
            n = q_lens[0]
            qs = q.transpose(0, 1)[None]  # [1, H, n, D]
            ks = torch.randn(1, h_kv, n, d, device=dev, dtype=dtype)
            vs = torch.randn_like(ks)
            try:
                sdpa_ms = timer(
                    functools.partial(
                        torch.nn.functional.scaled_dot_product_attention,
                        qs,
                        ks,
                        vs,
                        is_causal=True,
                        scale=scale,
                        enable_gqa=h != h_kv,
                    )
                )
            except Exception as e:  # noqa: BLE001 - a yardstick only
                print(f"  sdpa failed: {type(e).__name__}: {e}")
            ks = vs = None  # free before the next shape
        row = {
            "label": label,
            "q_lens": q_lens if len(q_lens) <= 8 else len(q_lens),
            "context": max(ctx),
            "splits": splits,
            "ms": ms,
            "flops": flops,
            "tflops": tf,
            "pct_peak": round(100 * tf / peak_tf, 1) if peak_tf else None,
            "sdpa_ms": sdpa_ms,
            "sdpa_tflops": flops / sdpa_ms / 1e9 if sdpa_ms else None,
        }
        out["prefill"].append(row)
        print(
            f"{label:<18} {splits:>6} {ms:>9.3f} {tf:>8.1f} {row['pct_peak'] or '-':>6} "
            f"{sdpa_ms if sdpa_ms is None else round(sdpa_ms, 3)!s:>9} "
            f"{row['sdpa_tflops'] if sdpa_ms is None else round(row['sdpa_tflops'], 1)!s:>9}"
        )
        save()

    # ---- ORCA's merged steps: running decodes plus one prefill chunk -----------------------------
    mixed = [(2, 80, 16)] if smoke else [(32, 2048, 512), (64, 4096, 512), (128, 1024, 2048)]
    print(f"\n[{h}x{h_kv}x{d}] mixed steps")
    for b, c, chunk in mixed:
        if over_budget():
            out["truncated"] = True
            return
        q_lens, ctx = [1] * b + [chunk], [c] * b + [chunk]
        q, cu, sl, bt = pool.step(q_lens, ctx, h, d, dtype)
        o = torch.empty_like(q)
        splits = choose_num_splits(q.shape[0], len(ctx), h_kv, h // h_kv, chunk, c, sms, dtype)
        ms = timer(
            functools.partial(
                unified_attention,
                q,
                pool.k,
                pool.v,
                cu,
                sl,
                bt,
                scale,
                o,
                max_seqlen_q=chunk,
                max_seqlen_k=max(ctx),
                num_splits=splits,
            )
        )
        moved = 2 * sum(ctx) * h_kv * d * esz + 2 * q.numel() * esz
        gbps = moved / ms / 1e6
        row = {
            "label": f"{b}x1@{c} + {chunk}",
            "splits": splits,
            "ms": ms,
            "gbps": gbps,
            "pct_peak": pct(gbps, peak),
            "tflops": 4 * h * d * visible_pairs(q_lens, ctx) / ms / 1e9,
        }
        out["mixed"].append(row)
        print(
            f"{row['label']:<22} splits {splits:>3} {ms:>9.3f} ms {gbps:>7.0f} GB/s {row['pct_peak'] or '-'}% "
            f"{row['tflops']:.1f} TFLOP/s"
        )
        save()

    # ---- store_kv --------------------------------------------------------------------------------
    print(f"\n[{h}x{h_kv}x{d}] store_kv")
    for t in (1, 16) if smoke else (1, 64, 256, 4096):
        kc = torch.zeros(t // bs + 2, bs, h_kv, d, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, device=dev, dtype=dtype)
        key = qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d)
        value = qkv[:, (h + h_kv) * d :].view(t, h_kv, d)
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:t]
        ms = timer(functools.partial(store_kv, key, value, kc, vc, slots))
        ref_ms = timer(functools.partial(torch_attention.store_kv, key, value, kc, vc, slots), max_iters=5)
        gbps = 4 * t * h_kv * d * esz / ms / 1e6
        out["store_kv"].append({"tokens": t, "ms": ms, "torch_ms": ref_ms, "gbps": gbps, "pct_peak": pct(gbps, peak)})
        print(f"T={t:<6} {ms:>9.4f} ms (torch {ref_ms:.4f}) {gbps:>7.0f} GB/s")
        save()


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument(
        "--shapes",
        default="32x8x128",
        help="comma list of HxH_kvxD; the first gets the full grid, the rest the quick one",
    )
    ap.add_argument("--heads", type=int, default=None, help="(old form) with --kv-heads/--head-dim: one layout")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--quick", action="store_true", help="quick grid for every layout")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU (or GPU) tiny sizes; on CPU under TRITON_INTERPRET=1, fp32: proves the code paths",
    )
    ap.add_argument(
        "--splits",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help=f"split counts to time per decode shape (default {','.join(map(str, SPLIT_CANDIDATES))})",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the PyTorch timings")
    ap.add_argument(
        "--reference-max-tokens",
        type=int,
        default=1 << 18,
        help="time the PyTorch twin only for decode steps with B * ctx <= this",
    )
    ap.add_argument("--max-cache-gib", type=float, default=40.0, help="cap on the K/V pool per layout")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; no new shape starts after it")
    ap.add_argument("--json", default=None, help="write results here (rewritten after every shape)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks/kernels.py: no CUDA device; nothing to time (GPU figures not measured).")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "no CUDA device"}, f)
        return 0
    if not cuda:
        # Before any kernel module is imported: @triton.jit reads it at definition time.
        os.environ["TRITON_INTERPRET"] = "1"
        if args.dtype != "fp32":
            print("smoke on CPU: fp32 (the interpreter computes bf16 wrongly)")
            args.dtype = "fp32"
    import triton

    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET=1)"
    dtype = DTYPES[args.dtype]
    timer = Timer(dev)
    peak = args.peak_gbps or (peak_gbps(name) if cuda else None)
    copy_bw = copy_gbps(dev, timer)
    peak_tf = lookup(PEAK_BF16_TFLOPS, name) if cuda and dtype != torch.float32 else None
    if args.heads:
        layouts = [(args.heads, args.kv_heads or args.heads, args.head_dim or 128)]
    elif args.smoke and not cuda:
        layouts = [(4, 2, 64)]
    else:
        layouts = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
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
        f"{round(copy_bw) if copy_bw else '-'} GB/s (measured), block_size {args.block_size}"
    )

    def save():
        if args.json:
            for run in result["runs"]:
                run["summary"] = summarize(run)
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.json)

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
        run: dict = {}
        result["runs"].append(run)
        bench_layout(args, h, h_kv, d, args.quick or i > 0, env, run, save)
        if cuda:
            torch.cuda.empty_cache()
        if run.get("truncated"):
            print(f"time budget of {args.time_budget} s reached; stopping")
            break
    for run in result["runs"]:
        run["summary"] = summarize(run)
        print(
            f"\nsummary {run['heads']}x{run['kv_heads']}x{run['head_dim']}: "
            f"{json.dumps({k: v for k, v in run['summary'].items() if k != 'split_disagreements'})}"
        )
    result["elapsed_s"] = time.perf_counter() - env["t0"]
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

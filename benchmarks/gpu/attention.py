"""Time the Triton attention kernels on a CUDA GPU: decode bandwidth, prefill throughput, split-K.

    orcaserve-bench gpu kernels [--dtype bf16] [--shapes 32x8x128,9x3x64] [--quick] [--time-budget S]
    orcaserve-bench gpu kernels --smoke      # CPU, TRITON_INTERPRET=1, tiny sizes: every code path

Per head layout HxH_kvxD (the first gets the full grid, the others the quick one): decode at batch
1-256 x context 1k-32k, every split count up to context/256 timed beside the one
`choose_num_splits` picks (the table the heuristic was fitted to, docs/kernels.md "Split-K
heuristic, refitted on the H200"), its bandwidth as a share of the datasheet peak and of the
measured copy bandwidth, and the PyTorch twin at small decode shapes; prefill TFLOP/s beside
SDPA's; ORCA's mixed steps; store_kv. Each timed call follows a 256 MiB write that evicts the L2;
medians of CUDA events. The JSON is rewritten after every shape, so a run cut short (or stopped by
--time-budget, which starts no new shape) keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

from orcaserve.bench.gpu.common import (
    DTYPES,
    PEAK_BF16_TFLOPS,
    PEAK_GBPS,
    Results,
    Timer,
    copy_gbps,
    device,
    device_name,
    lookup,
    torch_dtype,
)
from orcaserve.bench.gpu.summary import kernels_summary

BLOCK_SIZE = 16  # tokens per KV cache block, the engine's default
SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)  # split-K counts timed per decode shape
REFERENCE_MAX_TOKENS = 1 << 18  # the PyTorch twin is timed on decode steps of B * ctx <= this
MAX_CACHE_GIB = 40.0  # the K/V pool of one layout, at most


MIXED, STORE_KV = [(32, 2048, 512), (64, 4096, 512), (128, 1024, 2048)], (1, 64, 256, 4096)
FRESH_4K, CHUNK_2K = ("fresh 4k", [4096], [4096]), ("chunk 2k @ 16k", [2048], [16384])
# grid: (decode batches, decode contexts, prefills (label, new tokens, contexts), mixed steps
# (decodes, their context, the chunk), store_kv's tokens)
GRIDS = {
    "smoke": ((1, 2), (64, 160), [("fresh 32", [32], [32]), ("chunk 16 @ 80", [16], [80])], [(2, 80, 16)], (1, 16)),
    "quick": ((1, 8, 64, 256), (1024, 4096, 32768), [FRESH_4K, CHUNK_2K], MIXED, STORE_KV),
    "full": ((1, 2, 4, 8, 16, 32, 64, 128, 256), (1024, 2048, 4096, 8192, 16384, 32768),
             [("fresh 1k", [1024], [1024]), FRESH_4K, ("fresh 16k", [16384], [16384]),
              ("batch 8 x 2k", [2048] * 8, [2048] * 8), CHUNK_2K], MIXED, STORE_KV),
}  # fmt: skip


def visible_pairs(q_lens, ctx) -> int:
    """(query, key) pairs a causal step computes: new token j of a request sees ctx - n + j + 1 keys."""
    return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctx, strict=True))


class Layout:
    """One head layout (H x H_kv x D): its K/V pool, big enough for the largest step (each step gets
    shuffled blocks of it), the timings it records into `out` and the run's yardsticks."""

    def __init__(self, h: int, h_kv: int, d: int, quick: bool, run: argparse.Namespace, out: dict[str, Any]):
        import torch

        self.h, self.h_kv, self.d, self.quick, self.out = h, h_kv, d, quick, out
        self.dev, self.dtype, self.smoke, self.timer = run.dev, run.dtype, run.smoke, run.timer
        self.res, self.budget, self.save = run.res, run.budget, run.save
        out["grid"] = "smoke" if self.smoke else ("quick" if quick else "full")
        self.batches, self.contexts, self.prefills, self.mixed_steps, self.store_tokens = GRIDS[out["grid"]]
        cuda = self.dev.type == "cuda"
        budget = min(MAX_CACHE_GIB * (1 << 30), 0.6 * torch.cuda.mem_get_info(self.dev)[0]) if cuda else 64 << 20
        need = max(max(b * c for b in self.batches for c in self.contexts), 8 * 2048, 16384)
        self.pool_tokens = int(min(need, budget // (2 * h_kv * d * self.dtype.itemsize)))
        blocks = -(-self.pool_tokens // BLOCK_SIZE) + len(self.batches) * max(self.batches)
        self.k = torch.randn(blocks, BLOCK_SIZE, h_kv, d, device=self.dev, dtype=self.dtype)
        self.v = torch.randn_like(self.k)
        out.update(heads=h, kv_heads=h_kv, head_dim=d, block_size=BLOCK_SIZE, decode=[], prefill=[], mixed=[])
        out.update(store_kv=[])
        out["pool_gib"] = round(self.k.numel() * 2 * self.dtype.itemsize / (1 << 30), 2)

    def step(self, q_lens: list[int], ctx: list[int]):
        """q [sum(q_lens), H, D], cu_seqlens, seq_lens, block tables over shuffled pool blocks."""
        import torch

        dev, per_req = self.dev, [max(1, -(-c // BLOCK_SIZE)) for c in ctx]
        if sum(per_req) > self.k.shape[0]:
            raise ValueError(f"step needs {sum(per_req)} blocks, the pool has {self.k.shape[0]}")
        perm = torch.randperm(self.k.shape[0], device=dev)[: sum(per_req)].to(torch.int32)
        tables = torch.zeros(len(ctx), max(per_req), dtype=torch.int32, device=dev)
        for i, n in enumerate(per_req):
            tables[i, :n] = perm[sum(per_req[:i]) : sum(per_req[: i + 1])]
        cu = torch.zeros(len(ctx) + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, device=dev), 0)
        q = torch.randn(int(sum(q_lens)), self.h, self.d, device=dev, dtype=self.dtype)
        return q, cu, torch.tensor(ctx, dtype=torch.int32, device=dev), tables

    def attend(self, q_lens: list[int], ctx: list[int], splits: int | None = None, step=None) -> tuple[Any, ...]:
        """(median ms of one `unified_attention` call, its split count, q, o) on `step` (default: a
        new one); `splits` None: the count the engine would choose for this step."""
        import torch

        from orcaserve.kernels.triton.attention import choose_num_splits, num_sms, unified_attention

        q, cu, sl, bt = step or self.step(q_lens, ctx)
        if splits is None:
            splits = choose_num_splits(
                q.shape[0],
                len(ctx),
                self.h_kv,
                self.h // self.h_kv,
                max(q_lens),
                max(ctx),
                num_sms(self.dev),
                self.dtype,
                head_dim=self.d,
            )
        o = torch.empty_like(q)
        call = functools.partial(unified_attention, q, self.k, self.v, cu, sl, bt, self.d**-0.5, o, num_splits=splits)
        return self.timer(functools.partial(call, max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx))), splits, q, o

    def record(self, section: str, row: dict[str, Any]) -> bool:
        """Appends and prints `row`, saves the run; False once --time-budget has passed."""
        self.out[section].append(row)
        cells = (f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in row.items() if not isinstance(v, dict))
        print(f"[{self.h}x{self.h_kv}x{self.d}] {section}: " + " ".join(cells))
        self.save()
        if self.res.over(self.budget):
            self.out["truncated"] = True
        return not self.out.get("truncated")

    def pct(self, value: float, ceiling: str) -> float | None:
        """`value` as a percentage of the run's figure `ceiling` (a datasheet peak, the copy bandwidth)."""
        top = self.res.data[ceiling]
        return round(100 * value / top, 1) if top else None


def decode(lay: Layout) -> bool:
    """Bandwidth, and the split-K choice against the measured best."""
    import torch

    from orcaserve.kernels.pytorch import attention as torch_attention
    from orcaserve.kernels.triton.attention import select_config

    group, esz = lay.h // lay.h_kv, lay.dtype.itemsize
    for c in lay.contexts:
        for b in lay.batches:
            if b * c > lay.pool_tokens:
                lay.out["decode"].append({"batch": b, "context": c, "skipped": "cache pool too small"})
                continue
            step = lay.step([1] * b, [c] * b)  # every split count computes the same attention
            heur_ms, heur, q, o = lay.attend([1] * b, [c] * b, None, step)
            max_split = 2 if lay.smoke else c // 256  # smoke: still run the split-K kernels
            times, first, max_diff = {heur: heur_ms}, o.to(torch.float32, copy=True), 0.0
            for s in sorted({s for s in SPLIT_CANDIDATES if s == 1 or s <= max_split} - {heur}):
                times[s], _, _, o = lay.attend([1] * b, [c] * b, s, step)
                max_diff = max(max_diff, (o.float() - first).abs().max().item())
            best = min(times, key=lambda s: times[s])
            moved = 2 * b * c * lay.h_kv * lay.d * esz + 2 * q.numel() * esz
            gbps, ref_ms = moved / times[heur] / 1e6, None
            programs = (b // (select_config(1, group, lay.dtype)["block_m"] // group) + b) * lay.h_kv
            if b * c <= REFERENCE_MAX_TOKENS:
                try:
                    plan = torch_attention.TorchAttentionPlan(*step[1:], BLOCK_SIZE)
                    ref_ms = lay.timer(functools.partial(plan.attend, q, lay.k, lay.v, lay.d**-0.5, o), 5)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
            row = dict(batch=b, context=c, programs=programs, heuristic_splits=heur, best_splits=best)
            row.update(heuristic_ms=times[heur], best_ms=times[best], heuristic_over_best=times[heur] / times[best])
            row.update(ms_by_splits={str(k): v for k, v in sorted(times.items())}, bytes=moved, gbps=gbps)
            row.update(pct_peak=lay.pct(gbps, "peak_gbps_datasheet"), pct_copy=lay.pct(gbps, "copy_gbps_measured"))
            row.update(best_gbps=moved / times[best] / 1e6, torch_ms=ref_ms, max_diff_across_splits=max_diff)
            if not lay.record("decode", row):
                return False
    return True


def prefill(lay: Layout) -> bool:
    """Fresh prompts, a batch, a chunk over a long cache; causal TFLOP/s beside SDPA's."""
    import torch

    h, h_kv, d = lay.h, lay.h_kv, lay.d
    for label, q_lens, ctx in lay.prefills:
        ms, splits, q, _ = lay.attend(q_lens, ctx)
        flops = 4 * h * d * visible_pairs(q_lens, ctx)
        sdpa_ms = None
        if len(q_lens) == 1 and q_lens == ctx:  # fresh prompt: contiguous K/V, plain causal SDPA
            qs = q.transpose(0, 1)[None]  # [1, H, n, D]
            ks = torch.randn(1, h_kv, q_lens[0], d, device=lay.dev, dtype=lay.dtype)
            sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qs, ks, torch.randn_like(ks))
            try:
                sdpa_ms = lay.timer(functools.partial(sdpa, is_causal=True, scale=d**-0.5, enable_gqa=h != h_kv))
            except Exception as e:  # noqa: BLE001 - a yardstick only
                print(f"  sdpa failed: {type(e).__name__}: {e}")
        tflops, sdpa_tf = flops / ms / 1e9, flops / sdpa_ms / 1e9 if sdpa_ms else None
        row = dict(label=label, q_lens=q_lens if len(q_lens) <= 8 else len(q_lens), context=max(ctx), splits=splits)
        row.update(ms=ms, flops=flops, tflops=tflops, pct_peak=lay.pct(tflops, "peak_tflops_datasheet"))
        row.update(sdpa_ms=sdpa_ms, sdpa_tflops=sdpa_tf)
        if not lay.record("prefill", row):
            return False
    return True


def mixed(lay: Layout) -> bool:
    """ORCA's merged steps: running decodes plus one prefill chunk."""
    esz = lay.dtype.itemsize
    for b, c, chunk in lay.mixed_steps:
        q_lens, ctx = [1] * b + [chunk], [c] * b + [chunk]
        ms, splits, q, _ = lay.attend(q_lens, ctx)
        gbps = (2 * sum(ctx) * lay.h_kv * lay.d * esz + 2 * q.numel() * esz) / ms / 1e6
        row = dict(label=f"{b}x1@{c} + {chunk}", splits=splits, ms=ms, gbps=gbps)
        row.update(
            pct_peak=lay.pct(gbps, "peak_gbps_datasheet"),
            tflops=4 * lay.h * lay.d * visible_pairs(q_lens, ctx) / ms / 1e9,
        )
        if not lay.record("mixed", row):
            return False
    return True


def store_kv(lay: Layout) -> bool:
    """The paged KV write, a decode batch up to a long prefill chunk, beside the PyTorch twin's."""
    import torch

    from orcaserve.kernels.pytorch import attention as torch_attention
    from orcaserve.kernels.triton.store_kv import store_kv as triton_store_kv

    h, h_kv, d, dev, bs = lay.h, lay.h_kv, lay.d, lay.dev, BLOCK_SIZE
    for t in lay.store_tokens:
        kc = torch.zeros(t // bs + 2, bs, h_kv, d, device=dev, dtype=lay.dtype)
        vc = torch.zeros_like(kc)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, device=dev, dtype=lay.dtype)
        kv = (qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d), qkv[:, (h + h_kv) * d :].view(t, h_kv, d))
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:t]
        ms = lay.timer(functools.partial(triton_store_kv, *kv, kc, vc, slots))
        ref_ms = lay.timer(functools.partial(torch_attention.store_kv, *kv, kc, vc, slots), max_iters=5)
        gbps = 4 * t * h_kv * d * lay.dtype.itemsize / ms / 1e6
        row = dict(tokens=t, ms=ms, torch_ms=ref_ms, gbps=gbps, pct_peak=lay.pct(gbps, "peak_gbps_datasheet"))
        if not lay.record("store_kv", row):
            return False
    return True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--shapes", default="32x8x128", help="HxH_kvxD list; the first gets the full grid, the rest quick")
    ap.add_argument("--peak-gbps", type=float, default=None, help="HBM peak (default: the datasheet's by name)")
    ap.add_argument("--quick", action="store_true", help="quick grid for every layout")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on the CPU under TRITON_INTERPRET=1, fp32")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; no new shape starts after it")


def run(args: argparse.Namespace) -> dict:
    dev = device("kernels", args.smoke)
    if isinstance(dev, dict):
        return dev
    import torch

    cuda, dtype, name = dev.type == "cuda", torch_dtype(args.dtype, dev), device_name(dev)
    args.dtype = "fp32" if not cuda else args.dtype  # the interpreter computes bf16 wrongly
    timer = Timer(dev)
    layouts = (
        [(4, 2, 64)]
        if args.smoke and not cuda
        else [tuple(int(x) for x in s.split("x")[:3]) for s in args.shapes.split(",")]
    )
    res = Results(args.out, device=name, dtype=args.dtype, smoke=args.smoke, runs=[])
    res.data["peak_gbps_datasheet"] = args.peak_gbps or (lookup(PEAK_GBPS, name) if cuda else None)
    res.data["copy_gbps_measured"] = copy_gbps(dev, timer)
    res.data["peak_tflops_datasheet"] = lookup(PEAK_BF16_TFLOPS, name) if cuda and args.dtype != "fp32" else None
    res.data["num_sms"] = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else None

    def save():
        for one in res.data["runs"]:
            one["summary"] = kernels_summary(one)
        res.save()

    d = res.data
    run = argparse.Namespace(dev=dev, dtype=dtype, smoke=args.smoke, timer=timer, res=res, budget=args.time_budget)
    run.save = save
    print(f"device {name}, {args.dtype}: {json.dumps({k: v for k, v in d.items() if 'peak' in k or 'copy' in k})}")
    for i, (h, h_kv, hd) in enumerate(layouts):
        one: dict = {}
        d["runs"].append(one)
        lay = Layout(h, h_kv, hd, args.quick or i > 0, run, one)
        all(section(lay) for section in (decode, prefill, mixed, store_kv))
        del lay
        if cuda:
            torch.cuda.empty_cache()
        if one.get("truncated"):
            print(f"time budget of {args.time_budget} s reached; stopping")
            break
    d["elapsed_s"] = time.perf_counter() - res.t0
    save()
    for one in d["runs"]:
        rest = {k: v for k, v in one["summary"].items() if k != "split_disagreements"}
        print(f"\nsummary {one['heads']}x{one['kv_heads']}x{one['head_dim']}: {json.dumps(rest)}")
    return d

"""The sections of benchmarks/kernel_bench.py for one head layout: decode, prefill, mixed, store_kv.

Imported by kernel_bench.py only after it has decided on TRITON_INTERPRET: `@triton.jit` reads that
variable when the kernel modules below are first imported.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orcaserve.bench.kernel_timing import SPLIT_CANDIDATES, CachePool, Timer, visible_pairs
from orcaserve.kernels.pytorch import attention as torch_attention
from orcaserve.kernels.triton.attention import choose_num_splits, num_sms, select_config, unified_attention
from orcaserve.kernels.triton.store_kv import store_kv

BLOCK_SIZE = 16  # tokens per KV cache block, the engine's default
REFERENCE_MAX_TOKENS = 1 << 18  # the PyTorch twin is timed on decode steps of B * ctx <= this
MAX_CACHE_GIB = 40.0  # the K/V pool of one layout, at most


@dataclass
class Layout:
    """What every section of one head layout (H x H_kv x D) shares; rows go into `out`."""

    args: argparse.Namespace
    h: int
    h_kv: int
    d: int
    quick: bool  # the quick grid (every layout after the first, or --quick)
    device: torch.device
    dtype: torch.dtype
    timer: Timer
    peak: float | None  # datasheet GB/s
    copy_bw: float | None  # measured GB/s
    peak_tf: float | None  # datasheet TFLOP/s
    t0: float  # start of the whole run, for --time-budget
    pool: CachePool
    pool_tokens: int
    out: dict
    save: Callable[[], None]

    @property
    def esz(self) -> int:
        return self.dtype.itemsize

    @property
    def decode_grid(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return grid(self.quick, self.args.smoke)

    @property
    def name(self) -> str:
        return f"{self.h}x{self.h_kv}x{self.d}"

    def over_budget(self) -> bool:
        """True once --time-budget has passed; marks the layout truncated."""
        budget = self.args.time_budget
        if budget is not None and time.perf_counter() - self.t0 > budget:
            self.out["truncated"] = True
            return True
        return False

    def pct(self, gbps: float, ceiling: float | None) -> float | None:
        return round(100 * gbps / ceiling, 1) if ceiling else None

    def attend(self, q, cu, sl, bt, o, max_q: int, max_k: int, splits: int) -> float:
        """Median ms of one `unified_attention` call."""
        pool, scale = self.pool, self.d**-0.5
        call = functools.partial(unified_attention, q, pool.k, pool.v, cu, sl, bt, scale, o, num_splits=splits)
        return self.timer(functools.partial(call, max_seqlen_q=max_q, max_seqlen_k=max_k))

    def splits(self, q, q_lens: list[int], ctx: list[int]) -> int:
        """The split count the engine would choose for this step."""
        group = self.h // self.h_kv
        sms = num_sms(self.device)
        return choose_num_splits(
            q.shape[0], len(ctx), self.h_kv, group, max(q_lens), max(ctx), sms, self.dtype, head_dim=q.shape[2]
        )


def grid(quick: bool, smoke: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Decode batches and contexts."""
    if smoke:
        return (1, 2), (64, 160)
    if quick:
        return (1, 8, 64, 256), (1024, 4096, 32768)
    return (1, 2, 4, 8, 16, 32, 64, 128, 256), (1024, 2048, 4096, 8192, 16384, 32768)


def bench_layout(
    args: argparse.Namespace, h: int, h_kv: int, d: int, quick: bool, env: dict, out: dict, save: Callable[[], None]
) -> None:
    """Every section for one head layout; results accumulate in `out` (saved after each shape)."""
    dev, dtype, bs = env["device"], env["dtype"], BLOCK_SIZE
    out.update(heads=h, kv_heads=h_kv, head_dim=d, block_size=bs, decode=[], prefill=[], mixed=[], store_kv=[])
    out["grid"] = "smoke" if args.smoke else ("quick" if quick else "full")
    batches, contexts = grid(quick, args.smoke)
    # One pool for the whole layout, sized for the largest decode step that fits in memory.
    token_bytes = 2 * h_kv * d * dtype.itemsize
    budget = (MAX_CACHE_GIB * (1 << 30)) if dev.type == "cuda" else (64 << 20)
    if dev.type == "cuda":
        budget = min(budget, 0.6 * torch.cuda.mem_get_info(dev)[0])
    need = max(max(b * c for b in batches for c in contexts), 8 * 2048, 16384)
    pool_tokens = int(min(need, budget // token_bytes))
    pool = CachePool(-(-pool_tokens // bs) + len(batches) * max(batches), bs, h_kv, d, dtype, dev)
    out["pool_gib"] = round(pool.k.numel() * 2 * dtype.itemsize / (1 << 30), 2)
    lay = Layout(
        args, h, h_kv, d, quick, dev, dtype, env["timer"], env["peak_gbps"], env["copy_gbps"], env["peak_tflops"],
        env["t0"], pool, pool_tokens, out, save,
    )  # fmt: skip
    for section in (decode, prefill, mixed, store_kv_section):
        if not section(lay):
            return


def decode(lay: Layout) -> bool:
    """Bandwidth and the split-K choice against the measured best; False when out of time."""
    args, h, h_kv, d, esz = lay.args, lay.h, lay.h_kv, lay.d, lay.esz
    batches, contexts = lay.decode_grid
    print(f"\n[{lay.name}] decode (median ms per call; heur = choose_num_splits, best = fastest measured)")
    print(
        f"{'B':>4} {'ctx':>6} {'progs':>6} {'heur':>5} {'best':>5} {'heur ms':>9} {'best ms':>9} {'ratio':>6} "
        f"{'GB/s':>7} {'%peak':>6} {'%copy':>6} {'torch ms':>9}"
    )
    for c in contexts:
        for b in batches:
            if lay.over_budget():
                return False
            if b * c > lay.pool_tokens:
                lay.out["decode"].append({"batch": b, "context": c, "skipped": "cache pool too small"})
                continue
            q_lens, ctx = [1] * b, [c] * b
            q, cu, sl, bt = lay.pool.step(q_lens, ctx, h, d, lay.dtype)
            heur = lay.splits(q, q_lens, ctx)
            block_q = select_config(1, h // h_kv, lay.dtype)["block_m"] // (h // h_kv)
            programs = (b // block_q + b) * h_kv
            o = torch.empty_like(q)
            max_split = 2 if args.smoke else c // 256  # smoke: still run the split-K kernels
            cands = sorted({s for s in SPLIT_CANDIDATES if s == 1 or s <= max_split} | {heur})
            times, first, max_diff = {}, None, 0.0
            for s in cands:
                times[s] = lay.attend(q, cu, sl, bt, o, 1, c, s)
                if first is None:
                    first = o.to(torch.float32, copy=True)
                else:  # every split count computes the same attention
                    max_diff = max(max_diff, (o.float() - first).abs().max().item())
            best = min(times, key=lambda s: times[s])
            moved = 2 * b * c * h_kv * d * esz + 2 * q.numel() * esz
            gbps = moved / times[heur] / 1e6
            ref_ms = None
            if b * c <= REFERENCE_MAX_TOKENS:
                try:
                    plan = torch_attention.TorchAttentionPlan(cu, sl, bt, BLOCK_SIZE)
                    attend = functools.partial(plan.attend, q, lay.pool.k, lay.pool.v, d**-0.5, o)
                    ref_ms = lay.timer(attend, max_iters=5)
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
                "pct_peak": lay.pct(gbps, lay.peak),
                "pct_copy": lay.pct(gbps, lay.copy_bw),
                "best_gbps": moved / times[best] / 1e6,
                "torch_ms": ref_ms,
                "max_diff_across_splits": max_diff,
            }
            lay.out["decode"].append(row)
            print(
                f"{b:>4} {c:>6} {programs:>6} {heur:>5} {best:>5} {times[heur]:>9.4f} {times[best]:>9.4f} "
                f"{row['heuristic_over_best']:>6.2f} {gbps:>7.0f} {row['pct_peak'] or '-':>6} "
                f"{row['pct_copy'] or '-':>6} {ref_ms if ref_ms is None else round(ref_ms, 3)!s:>9}"
            )
            lay.save()
    return True


def prefill(lay: Layout) -> bool:
    """Fresh prompts, a batch, a chunk over a long cache; causal TFLOP/s beside SDPA's."""
    h, h_kv, d, dev, dtype = lay.h, lay.h_kv, lay.d, lay.device, lay.dtype
    if lay.args.smoke:
        prefills = [("fresh 32", [32], [32]), ("chunk 16 @ 80", [16], [80])]
    elif lay.quick:
        prefills = [("fresh 4k", [4096], [4096]), ("chunk 2k @ 16k", [2048], [16384])]
    else:
        prefills = [
            ("fresh 1k", [1024], [1024]),
            ("fresh 4k", [4096], [4096]),
            ("fresh 16k", [16384], [16384]),
            ("batch 8 x 2k", [2048] * 8, [2048] * 8),
            ("chunk 2k @ 16k", [2048], [16384]),
        ]
    print(f"\n[{lay.name}] prefill")
    print(f"{'shape':<18} {'splits':>6} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'sdpa ms':>9} {'sdpa TF/s':>9}")
    for label, q_lens, ctx in prefills:
        if lay.over_budget():
            return False
        q, cu, sl, bt = lay.pool.step(q_lens, ctx, h, d, dtype)
        o = torch.empty_like(q)
        splits = lay.splits(q, q_lens, ctx)
        ms = lay.attend(q, cu, sl, bt, o, max(q_lens), max(ctx), splits)
        flops = 4 * h * d * visible_pairs(q_lens, ctx)
        tf = flops / ms / 1e9
        sdpa_ms = None
        if len(q_lens) == 1 and q_lens == ctx:  # fresh prompt: contiguous K/V, plain causal SDPA
            n = q_lens[0]
            qs = q.transpose(0, 1)[None]  # [1, H, n, D]
            ks = torch.randn(1, h_kv, n, d, device=dev, dtype=dtype)
            vs = torch.randn_like(ks)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            try:
                sdpa_ms = lay.timer(
                    functools.partial(sdpa, qs, ks, vs, is_causal=True, scale=d**-0.5, enable_gqa=h != h_kv)
                )
            except Exception as e:  # noqa: BLE001 - a yardstick only
                print(f"  sdpa failed: {type(e).__name__}: {e}")
            del ks, vs  # free before the next shape
        row = {
            "label": label,
            "q_lens": q_lens if len(q_lens) <= 8 else len(q_lens),
            "context": max(ctx),
            "splits": splits,
            "ms": ms,
            "flops": flops,
            "tflops": tf,
            "pct_peak": round(100 * tf / lay.peak_tf, 1) if lay.peak_tf else None,
            "sdpa_ms": sdpa_ms,
            "sdpa_tflops": flops / sdpa_ms / 1e9 if sdpa_ms else None,
        }
        lay.out["prefill"].append(row)
        print(
            f"{label:<18} {splits:>6} {ms:>9.3f} {tf:>8.1f} {row['pct_peak'] or '-':>6} "
            f"{sdpa_ms if sdpa_ms is None else round(sdpa_ms, 3)!s:>9} "
            f"{row['sdpa_tflops'] if sdpa_ms is None else round(row['sdpa_tflops'], 1)!s:>9}"
        )
        lay.save()
    return True


def mixed(lay: Layout) -> bool:
    """ORCA's merged steps: running decodes plus one prefill chunk."""
    h, h_kv, d, esz = lay.h, lay.h_kv, lay.d, lay.esz
    print(f"\n[{lay.name}] mixed steps")
    for b, c, chunk in [(2, 80, 16)] if lay.args.smoke else [(32, 2048, 512), (64, 4096, 512), (128, 1024, 2048)]:
        if lay.over_budget():
            return False
        q_lens, ctx = [1] * b + [chunk], [c] * b + [chunk]
        q, cu, sl, bt = lay.pool.step(q_lens, ctx, h, d, lay.dtype)
        o = torch.empty_like(q)
        splits = lay.splits(q, q_lens, ctx)
        ms = lay.attend(q, cu, sl, bt, o, chunk, max(ctx), splits)
        moved = 2 * sum(ctx) * h_kv * d * esz + 2 * q.numel() * esz
        gbps = moved / ms / 1e6
        row = {
            "label": f"{b}x1@{c} + {chunk}",
            "splits": splits,
            "ms": ms,
            "gbps": gbps,
            "pct_peak": lay.pct(gbps, lay.peak),
            "tflops": 4 * h * d * visible_pairs(q_lens, ctx) / ms / 1e9,
        }
        lay.out["mixed"].append(row)
        print(
            f"{row['label']:<22} splits {splits:>3} {ms:>9.3f} ms {gbps:>7.0f} GB/s {row['pct_peak'] or '-'}% "
            f"{row['tflops']:.1f} TFLOP/s"
        )
        lay.save()
    return True


def store_kv_section(lay: Layout) -> bool:
    """The paged KV write, a decode batch up to a long prefill chunk, beside the PyTorch twin's."""
    h, h_kv, d, dev, dtype, bs = lay.h, lay.h_kv, lay.d, lay.device, lay.dtype, BLOCK_SIZE
    print(f"\n[{lay.name}] store_kv")
    for t in (1, 16) if lay.args.smoke else (1, 64, 256, 4096):
        kc = torch.zeros(t // bs + 2, bs, h_kv, d, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        qkv = torch.randn(t, (h + 2 * h_kv) * d, device=dev, dtype=dtype)
        key = qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d)
        value = qkv[:, (h + h_kv) * d :].view(t, h_kv, d)
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:t]
        ms = lay.timer(functools.partial(store_kv, key, value, kc, vc, slots))
        ref_ms = lay.timer(functools.partial(torch_attention.store_kv, key, value, kc, vc, slots), max_iters=5)
        gbps = 4 * t * h_kv * d * lay.esz / ms / 1e6
        lay.out["store_kv"].append(
            {"tokens": t, "ms": ms, "torch_ms": ref_ms, "gbps": gbps, "pct_peak": lay.pct(gbps, lay.peak)}
        )
        print(f"T={t:<6} {ms:>9.4f} ms (torch {ref_ms:.4f}) {gbps:>7.0f} GB/s")
        lay.save()
    return True

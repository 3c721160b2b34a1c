"""What `fair_prefill_cap` should do to tenant B beside a flood, in a model of the step's cost
(docs/engine.md, "Prompt cap beside a below-share tenant"): the real `Scheduler` on hand-made
model outputs (no model runs), each step costing `base + decode_ms x decode rows + prompt_ms x
other tokens`. Tenant A: 24 closed-loop clients; B: one, its next request two steps after its last
ended (A's clients refill the freed seat first, as over HTTP); `max_num_seqs` 16, 512 tokens per
step; outputs U[32, 128], prompts U[32, 128] (as benchmarks/fairness.py) or, for A, `--long`.

    python benchmarks/fair_cap_model.py                      # about 40 s on one core
    python benchmarks/fair_cap_model.py --long 500,1500 --prompt-ms 1.0

The defaults fit the quiet Zen 2 run's decode steps (33.1 ms with 1 row, 52.9 ms with 16); what a
prompt token costs beside them is not measured (`--prompt-ms`). A model, not a measurement.
"""

from __future__ import annotations

import argparse
import random
import statistics

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.sampling_params import SamplingParams


def run(policy: str, cap: int | None, args: argparse.Namespace, seed: int, flood: int) -> dict:
    s = Scheduler(KVCacheManager(4096, 16), 16, 512, policy, TenantShares(), prefill_cap=cap)
    rngs = {"A": random.Random(seed), "B": random.Random(seed + 1000)}  # B's requests: the same in every run
    clock, start, count, b_next = 0.0, 0.0, 0, None
    arrived: dict[str, tuple[float, list[float]]] = {}
    ttft: list[float] = []
    e2e: list[float] = []
    tpot: list[float] = []
    tokens = 0

    def new(tenant: str) -> None:
        nonlocal count
        lo, hi = args.long if tenant == "A" and args.long else (32, 128)
        rng = rngs[tenant]
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(lo, hi))]
        r = Request(f"{tenant}{count}", prompt, SamplingParams(max_tokens=rng.randint(32, 128)), 0.0, tenant=tenant)
        count += 1
        s.add_request(r)
        arrived[r.request_id] = (clock, [])

    for _ in range(flood):
        new("A")
    new("B")
    for i in range(args.steps):
        if i == args.warmup:
            for xs in (ttft, e2e, tpot):
                xs.clear()
            tokens, start = 0, clock
        if b_next == i:
            new("B")
        out = s.schedule()
        s.update_after_step(out)
        decodes = sum(n == 1 for n in out.num_scheduled_tokens.values())
        clock += args.base_ms + args.decode_ms * decodes + args.prompt_ms * (out.total_tokens - decodes)
        for r in out.sampling:
            r.append_token(1)
            tokens += 1
            t0, firsts = arrived[r.request_id]
            firsts.append(clock)
            if len(r.output_token_ids) < r.params.max_tokens:
                continue
            s.finish_request(r, "length")
            del arrived[r.request_id]
            if r.tenant == "A":
                new("A")
                continue
            ttft.append(firsts[0] - t0)
            e2e.append(clock - t0)
            tpot.append((clock - firsts[0]) / max(1, len(firsts) - 1))
            b_next = i + 2
    return {
        "ttft": ttft,
        "e2e": e2e,
        "tpot": statistics.mean(tpot),
        "tok_s": tokens / (clock - start) * 1000,
        "capped": s.num_capped_steps,
    }


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="none,64,32,16", help="fair_prefill_cap values to compare (none: off)")
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--flood-clients", type=int, default=24)
    ap.add_argument("--base-ms", type=float, default=31.8)
    ap.add_argument("--decode-ms", type=float, default=1.32, help="per decode row")
    ap.add_argument("--prompt-ms", type=float, default=1.0, help="per prompt token (not measured)")
    ap.add_argument(
        "--long", type=lambda v: tuple(int(x) for x in v.split(",")), default=None, help="A's prompts lo,hi"
    )
    args = ap.parse_args()
    configs = [("B alone", None), ("fcfs", None)] + [
        ("fair", None if c == "none" else int(c)) for c in args.caps.split(",")
    ]
    print("| policy | cap | B requests | B p50 TTFT (ms) | B p99 TTFT (ms) | B p50 e2e (ms) | B TPOT (ms) ", end="")
    print("| tok/s | vs fcfs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for policy, cap in configs:
        flood = 0 if policy == "B alone" else args.flood_clients
        runs = [run("fair" if flood == 0 else policy, cap, args, seed, flood) for seed in range(args.seeds)]
        ttft = [x for r in runs for x in r["ttft"]]
        e2e = [x for r in runs for x in r["e2e"]]
        tok_s = statistics.mean(r["tok_s"] for r in runs)
        base = base or (tok_s if flood else None)
        tpot = statistics.mean(r["tpot"] for r in runs)
        ratio = f"{tok_s / base:.3f}" if base else ""
        row = f"| {policy} | {cap} | {len(e2e)} | {pct(ttft, 0.5):.0f} | {pct(ttft, 0.99):.0f} | {pct(e2e, 0.5):.0f} "
        print(row + f"| {tpot:.1f} | {tok_s:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()

"""Latency targets and goodput: a two-class workload through the engine in one process, fcfs
against the latency-target step, and a sweep over the TPOT target (docs/latency-targets.md).

    orcaserve-bench slo [--seconds 40] [--rate 2] [--flood 8] [--sweep 2,3,4,6] [--out out.json]

Interactive requests (`--short` prompt tokens, `--short-out` out) arrive as a Poisson process of
`--rate` per second with targets; a batch flood keeps `--flood` requests of `--long` tokens in
flight with none. Targets default to multiples of the decode step measured first with the flood
alone (`--tpot-x`, `--ttft-x`), or are given in ms. Per class and run: attainment, goodput by
vLLM's definition (requests per second meeting every target, TPOT = (e2e - TTFT) / (output
tokens - 1)), output throughput. The first run serves the same requests without classes
(`--policy`); `--alone` first runs the interactive class without the flood, and gives each run's
p50 TPOT as a multiple of it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from orcaserve.bench.peers.parts import ENGINE_LIMITS
from orcaserve.bench.result import pct
from orcaserve.bench.serve.client import Result
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.core.slo_class import check_slo_classes
from orcaserve.scheduler.model.loader import default_model_path

# The engine of every run, and of orcaserve's server in slo-http: the peers' limits, bf16.
ENGINE_ARGS = {**ENGINE_LIMITS, "dtype": "bfloat16", "kv_cache_memory": 512 << 20}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` (any of them) as vLLM's `--goodput` takes it -> {name: seconds}."""
    targets = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        targets[name] = float(ms) / 1000.0
    return targets


def meets(r: Result, targets: dict[str, float]) -> bool:
    """Whether a request that completed met every target (TPOT of one output token: 0)."""
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return r.error is None and all((got[name] or 0.0) <= limit for name, limit in targets.items())


def by_class(records: list[Result], targets: dict[str, float], seconds: float) -> dict:
    """Per class (`Result.system`): attainment of the interactive class's `targets` (seconds),
    goodput (requests per second meeting every target of their class: the batch class has none,
    each completed one counts), TTFT/TPOT percentiles in ms."""
    out: dict = {}
    for cls in ("interactive", "batch"):
        rs = [r for r in records if r.system == cls]
        ok = [r for r in rs if r.error is None]
        if not rs:
            continue
        judged = targets if cls == "interactive" else {}
        row: dict = {"requests": len(rs), "errors": len(rs) - len(ok)}
        row["goodput_rps"] = round(sum(meets(r, judged) for r in ok) / seconds, 3)
        if judged:
            row["attainment"] = round(sum(meets(r, judged) for r in ok) / len(rs), 3)
            for name in judged:
                row[f"{name}_attainment"] = round(sum(meets(r, {name: judged[name]}) for r in ok) / len(rs), 3)
        ttft, tpot = [r.ttft or 0.0 for r in ok], [r.tpot or 0.0 for r in ok]
        for name, vals in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 99, 100):
                v = pct(vals, q)
                row[f"{'max' if q == 100 else f'p{q}'}_{name}_ms"] = None if v is None else round(1000 * v, 1)
        out[cls] = row
    return out


class Workload:
    """The two classes' requests, driven through `engine.step()` on the wall clock."""

    def __init__(self, engine: Engine, args: argparse.Namespace, seed: int) -> None:
        self.engine, self.args = engine, args
        self.rng = random.Random(seed)
        self.open: dict[str, tuple[str, float, list[float]]] = {}  # id -> (class, arrival, token times)
        self.records: list[Result] = []
        self.count = 0

    def add(self, cls: str, slo_class: str | None, now: float) -> None:
        long = cls == "batch"
        n = self.args.long if long else self.args.short
        prompt = [self.rng.randrange(1000, 40000) for _ in range(n)]
        out = self.args.long_out if long else self.args.short_out
        rid = f"{cls}-{self.count}"
        self.count += 1
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        self.engine.add_request(rid, prompt, params, arrival_time=now, tenant=cls, slo_class=slo_class)
        self.open[rid] = (cls, now, [])

    def run(self, seconds: float, classes: bool) -> tuple[list[Result], float, float]:
        """Run for `seconds`; (records of requests that arrived in the window, output tokens/s,
        tokens computed (prompt and output) per second), the rates over the window."""
        start = time.time()
        end = start + seconds
        arrivals, t = [], start
        while True:
            t += self.rng.expovariate(self.args.rate)
            if t >= end:
                break
            arrivals.append(t)
        for _ in range(self.args.flood):
            self.add("batch", "batch" if classes else None, start)
        tokens = computed = 0
        while arrivals or any(cls == "interactive" for cls, _, _ in self.open.values()):
            now = time.time()
            while arrivals and arrivals[0] <= now:
                self.add("interactive", "interactive" if classes else None, arrivals.pop(0))
            if not self.engine.has_unfinished():
                time.sleep(max(0.0, min(arrivals[0] - now, 0.05)) if arrivals else 0.0)
                continue
            steps = self.engine.stats.num_steps
            outs = self.engine.step()
            if self.engine.stats.num_steps > steps and time.time() <= end:
                computed += self.engine.stats.last_step_tokens
            for out in outs:
                cls, arrival, times = self.open[out.request_id]
                stamp = time.time()
                times += [stamp] * len(out.new_token_ids)
                tokens += len(out.new_token_ids) if stamp <= end else 0
                if out.finished:
                    del self.open[out.request_id]
                    if out.finish_reason in ("stop", "length") and out.times.first_token is not None:
                        first, done, n = out.times.first_token, out.times.finished or stamp, out.completion_tokens
                        r = Result(len(self.records), cls, None, 0, n, arrival, first - arrival, done - arrival)
                        r.output_tokens, r.tpot = n, (done - first) / (n - 1) if n > 1 else None
                        self.records.append(r)
                    if cls == "batch" and stamp < end:
                        self.add("batch", "batch" if classes else None, stamp)
        for rid in list(self.open):  # the flood's last requests
            self.engine.abort(rid)
            del self.open[rid]
        return self.records, tokens / seconds, computed / seconds


def decode_steps(engine: Engine, rows: int, context: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds of each of `steps` whole engine steps while `rows` requests of `context` tokens
    decode; their prefill runs first, untimed, and they are aborted after."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"r{rng.randrange(1 << 30)}-{i}" for i in range(rows)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1000, 40000) for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < rows:  # prefill (chunked by the token budget), one token each
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return times


def decode_step(engine: Engine, args: argparse.Namespace) -> float:
    """Median seconds of a step of the flood's decodes alone (the unit the targets scale)."""
    return statistics.median(decode_steps(engine, args.flood, args.long, args.long_out, random.Random(0)))


def summary(records: list[Result], targets: dict[str, float], seconds: float, rates: tuple[float, float]) -> dict:
    out = {"output_tokens_per_s": round(rates[0], 2), "computed_tokens_per_s": round(rates[1], 1)}
    return {**out, **by_class(records, targets, seconds)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=40.0, help="each run's arrival window")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive arrivals per second (Poisson)")
    parser.add_argument("--flood", type=int, default=8, help="batch requests kept in flight")
    parser.add_argument("--short", type=int, default=32, help="interactive prompt tokens")
    parser.add_argument("--short-out", type=int, default=32, help="interactive output tokens")
    parser.add_argument("--long", type=int, default=900, help="batch prompt tokens")
    parser.add_argument("--long-out", type=int, default=64, help="batch output tokens")
    parser.add_argument("--tpot-x", type=float, default=4.0, help="TPOT target in decode steps")
    parser.add_argument("--ttft-x", type=float, default=10.0, help="TTFT target in decode steps")
    parser.add_argument("--tpot-ms", type=float, default=None, help="TPOT target (overrides --tpot-x)")
    parser.add_argument("--ttft-ms", type=float, default=None, help="TTFT target (overrides --ttft-x)")
    parser.add_argument("--sweep", default="2,3,6", help="further TPOT targets to run slo at, in decode steps")
    parser.add_argument("--goodput", nargs="*", default=None, help="extra vLLM-style targets ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "fair"], help="scheduling_policy")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--alone", action="store_true", help="first run the interactive class without the flood: TPOT as x alone"
    )


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    # every run computes the same prompts in full; under fair, each class is a tenant
    engine = Engine.from_pretrained(
        default_model_path(), **ENGINE_ARGS, enable_prefix_caching=False, scheduling_policy=args.policy
    )
    step = decode_step(engine, args)
    tpot_ms = args.tpot_ms or round(1000 * step * args.tpot_x, 1)
    ttft_ms = args.ttft_ms or round(1000 * step * args.ttft_x, 1)
    result: dict = {"decode_step_ms": round(1000 * step, 2), "targets": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}}
    targets = {"ttft": ttft_ms / 1000.0, "tpot": tpot_ms / 1000.0}
    print("decode step", json.dumps(result), flush=True)
    if args.goodput:
        result["goodput_targets"] = {k: v * 1000 for k, v in parse_goodput(args.goodput).items()}
    alone_tpot = None
    if args.alone:  # the light tenant's (interactive class's) time per output token without the flood
        engine.slo_classes = check_slo_classes({"interactive": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}, "batch": {}})
        quiet = argparse.Namespace(**{**vars(args), "flood": 0})
        records, out_rate, computed_rate = Workload(engine, quiet, seed=1).run(args.seconds, True)
        result["interactive alone"] = summary(records, targets, args.seconds, (out_rate, computed_rate))
        alone_tpot = result["interactive alone"]["interactive"]["p50_tpot_ms"]
        print("interactive alone", json.dumps(result["interactive alone"]), flush=True)
    for name, classes, tpot in [(args.policy, False, tpot_ms), (f"{args.policy}+slo", True, tpot_ms)] + [
        (f"slo@tpot={float(x) * step * 1000:.0f}ms", True, float(x) * step * 1000) for x in args.sweep.split(",") if x
    ]:
        engine.slo_classes = check_slo_classes({"interactive": {"ttft_ms": ttft_ms, "tpot_ms": tpot}, "batch": {}})
        late = getattr(engine.stats.slo.get("interactive"), "late", 0)
        records, out_rate, computed_rate = Workload(engine, args, seed=1).run(args.seconds, classes)
        row = summary(records, {**targets, "tpot": tpot / 1000.0}, args.seconds, (out_rate, computed_rate))
        if args.goodput:
            extra = parse_goodput(args.goodput)
            row["goodput_rps_extra"] = round(sum(meets(r, extra) for r in records) / args.seconds, 3)
        row["step_cost_relative_error"] = engine.scheduler.cost.relative_error
        if classes:  # found unable to make their TTFT (then served best effort)
            row["interactive_late"] = getattr(engine.stats.slo.get("interactive"), "late", 0) - late
        if alone_tpot and "interactive" in row:
            row["interactive"]["p50_tpot_x_alone"] = round(row["interactive"]["p50_tpot_ms"] / alone_tpot, 2)
        result[name] = row
        print(name, json.dumps(row), flush=True)
    return result


if __name__ == "__main__":
    import sys

    from orcaserve.bench import cli

    sys.exit(cli.main(["slo", *sys.argv[1:]]))

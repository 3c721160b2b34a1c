"""Latency targets and goodput: a two-class workload through the engine in one process, fcfs
against the latency-target step (docs/latency-targets.md), and a sweep over the TPOT target.

    orcaserve-bench slo [--seconds 40] [--rate 2] [--flood 8] [--sweep 2,3,4,6] [--out out.json]

Interactive requests (prompts of `--short` random tokens, `--short-out` tokens out) arrive as a
Poisson process of `--rate` per second with targets; a batch flood keeps `--flood` requests of
`--long`-token prompts in flight (closed loop: a new one the moment one ends) with none. Targets
default to multiples of the decode step measured first with the flood alone (`--tpot-x` 4,
`--ttft-x` 10), or are given in ms. Each run reports per class the attainment (TTFT, TPOT,
both), goodput by vLLM's definition (`request_goodput`: requests per second meeting every
target, TPOT per request = (e2e - TTFT) / (output tokens - 1)) and the total output throughput.
The first run serves the same requests without classes (`--policy`, fcfs by default; under fair
each class is a tenant), judged against the same targets; the others with them. `--alone` runs
the interactive class without the flood first, and gives each run's p50 TPOT as a multiple of it
(the light tenant's time per output token beside the flood against its time alone).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass

import torch

from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.core.slo_budget import check_slo_classes
from orcaserve.scheduler.model.loader import default_model_path


@dataclass
class Record:
    """One finished request, in seconds from its arrival."""

    cls: str
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` (any of them) as vLLM's `--goodput` takes it -> {name: seconds}."""
    targets = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        targets[name] = float(ms) / 1000.0
    return targets


def meets(r: Record, targets: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    return all(got[name] <= limit for name, limit in targets.items())


def request_goodput(records: list[Record], targets: dict[str, float], duration: float) -> float:
    """vLLM's goodput: completed requests per second that meet every target."""
    return sum(meets(r, targets) for r in records) / duration


class Workload:
    """The two classes' requests, driven through `engine.step()` on the wall clock."""

    def __init__(self, engine: Engine, args: argparse.Namespace, seed: int) -> None:
        self.engine, self.args = engine, args
        self.rng = random.Random(seed)
        self.open: dict[str, tuple[str, float, list[float]]] = {}  # id -> (class, arrival, token times)
        self.records: list[Record] = []
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

    def run(self, seconds: float, classes: bool) -> tuple[list[Record], float, float]:
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
                        first, done = out.times.first_token, out.times.finished or stamp
                        self.records.append(Record(cls, first - arrival, done - arrival, out.completion_tokens))
                    if cls == "batch" and stamp < end:
                        self.add("batch", "batch" if classes else None, stamp)
        for rid in list(self.open):  # the flood's last requests
            self.engine.abort(rid)
            del self.open[rid]
        return self.records, tokens / seconds, computed / seconds


def decode_step(engine: Engine, args: argparse.Namespace) -> float:
    """Median seconds of a step of the flood's decodes alone (the unit the targets scale)."""
    w = Workload(engine, args, seed=0)
    for _ in range(args.flood):
        w.add("batch", None, time.time())
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if all(len(o.new_token_ids) == 1 for o in outs) and len(outs) == args.flood:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def summary(records: list[Record], targets: dict[str, float], seconds: float, rates: tuple[float, float]) -> dict:
    out: dict = {"output_tokens_per_s": round(rates[0], 2), "computed_tokens_per_s": round(rates[1], 1)}
    for cls in ("interactive", "batch"):
        rs = [r for r in records if r.cls == cls]
        if not rs:
            continue
        judged = targets if cls == "interactive" else {}
        row = {"requests": len(rs), "goodput_rps": round(request_goodput(rs, judged, seconds), 3)}
        if judged:
            row["attainment"] = round(sum(meets(r, judged) for r in rs) / len(rs), 3)
            for name in judged:
                row[f"{name}_attainment"] = round(sum(meets(r, {name: judged[name]}) for r in rs) / len(rs), 3)
        row["p50_ttft_ms"] = round(1000 * statistics.median(r.ttft for r in rs), 1)
        row["p99_ttft_ms"] = round(1000 * sorted(r.ttft for r in rs)[math.ceil(0.99 * len(rs)) - 1], 1)
        row["p50_tpot_ms"] = round(1000 * statistics.median(r.tpot for r in rs), 1)
        row["max_tpot_ms"] = round(1000 * max(r.tpot for r in rs), 1)
        out[cls] = row
    return out


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
    engine = Engine.from_pretrained(
        default_model_path(),
        dtype="bfloat16",
        max_num_seqs=32,
        kv_cache_memory=512 << 20,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,  # every run computes the same prompts in full
        scheduling_policy=args.policy,  # under fair, each class is a tenant
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
            row["goodput_rps_extra"] = round(request_goodput(records, parse_goodput(args.goodput), args.seconds), 3)
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

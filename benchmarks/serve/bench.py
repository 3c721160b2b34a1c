"""Load generator for a running TorchServe (orcaserve vs the request-level baseline), or for any
OpenAI completions endpoint (e.g. vLLM's server, benchmarks/peers/run.py). What it sends, what it
measures and how saturation is judged: docs/benchmark-serving.md "Load generator".

    orcaserve-bench serve --url http://127.0.0.1:8080 --key-file key_file.json \\
        --model smollm2 --model smollm2-baseline --rates 0.25,0.5,1,2 --duration 40 \\
        --out docs/results/benchmark-serving.json --plot docs/benchmark-serving.png
    orcaserve-bench serve --endpoint http://127.0.0.1:8000/v1/completions --key none \\
        --model vllm --model-name smollm2 --concurrency 32 --num-requests 96 --out vllm.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from orcaserve.bench import cli
from orcaserve.bench.result import machine, update_doc
from orcaserve.bench.serve import engine_counts, run_delay
from orcaserve.bench.serve import local as serve_local
from orcaserve.bench.serve.client import Result, run_one
from orcaserve.bench.serve.cpu_probe import CpuProbe
from orcaserve.bench.serve.cpu_probe import table as cpu_table
from orcaserve.bench.serve.report import BEGIN, END, command_line, markdown, plot, summarize, verdict
from orcaserve.bench.serve.workload import Spec, _counts, _range, make_workload


def read_key(args) -> str | None:
    if args.key:
        return None if args.key.lower() == "none" else args.key
    if os.environ.get("ORCASERVE_KEY"):
        return os.environ["ORCASERVE_KEY"]
    if args.key_file and os.path.exists(args.key_file):
        with open(args.key_file) as f:
            return json.load(f)["inference"]["key"]
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8080", help="TorchServe inference address")
    p.add_argument("--endpoint", action="append", default=[], help="OpenAI completions URL (once, or once per --model)")
    p.add_argument(
        "--model", action="append", default=[], help="model (label with --endpoint); first ours, second baseline"
    )
    p.add_argument("--model-name", default=None, help="the body's `model` (default: none, or --model with --endpoint)")
    p.add_argument("--key", help="inference key, `none`: no header (else $ORCASERVE_KEY, else --key-file)")
    p.add_argument("--key-file", default="key_file.json", help="TorchServe's key_file.json")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="one Poisson arrival rate (req/s)")
    load.add_argument("--rates", help="comma-separated Poisson rates (a sweep)")
    load.add_argument("--concurrency", type=int, help="closed loop of this many clients, --num-requests in all")
    p.add_argument("--num-requests", type=_counts, help="N, or N1,N2,... per rate (default: rate x --duration, >= 8)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--input-len", type=_range, default=(8, 128), help="prompt tokens A:B, uniform")
    p.add_argument("--output-len", type=_range, default=(1, 128), help="max_tokens A:B, uniform")
    p.add_argument("--token-range", type=_range, default=(1000, 40000), help="synthetic prompt token ids")
    p.add_argument("--dataset", help="JSONL prompts instead of synthetic ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests per system first")
    p.add_argument("--warmup-load", type=int, default=0, help="then N unrecorded requests of the measured kind")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout (s)")
    p.add_argument("--out", default="benchmark-serving.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--update-doc", default=None, help=f"write the results table between {BEGIN} / {END}")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--cpu-of",
        type=int,
        default=None,
        metavar="SID",
        help="the server's session id (its launcher's pid): CPU per process and thread over each measured load",
    )
    p.add_argument(
        "--engine-metrics",
        default=None,
        metavar="URL",
        help="orcaserve's Prometheus page (TorchServe's :8082/metrics): its step counters over each measured load",
    )
    p.add_argument(
        "--against-loop",
        default=None,
        metavar="JSON",
        help="`closed-loop --via engine,loop --out JSON`: HTTP's step-time excess over its loop run and the"
        " amplification of the compute threads' run delay (with --cpu-of and --engine-metrics)",
    )
    serve_local.add_arguments(p)


@dataclass
class Plan:
    """What one run sends where: rates, requests per rate, the systems' URLs."""

    rates: list[float | None]
    counts: dict[float | None, int]
    targets: list[tuple[str, str, str | None]]  # (system label, URL, body `model` field)
    headers: dict[str, str]
    base: str


def _plan(args: argparse.Namespace) -> Plan:
    if not args.model:
        raise SystemExit("serve: give --model (or --start-torchserve)")
    if args.rates:
        rates: list[float | None] = [float(x) for x in args.rates.split(",") if x.strip()]
    elif args.rate:
        rates = [args.rate]
    elif args.concurrency:
        rates = [None]
    else:
        raise SystemExit("serve: give --rate, --rates or --concurrency")
    if any(r is not None and r <= 0 for r in rates):
        raise SystemExit("serve: rates must be > 0")
    if len(args.endpoint) not in (0, 1, len(args.model)):
        raise SystemExit(f"serve: --endpoint: give one URL or one per --model ({len(args.model)})")
    if args.num_requests and len(args.num_requests) not in (1, len(rates)):
        raise SystemExit(f"serve: --num-requests: give one count or one per rate ({len(rates)})")
    n = args.num_requests or []
    counts = {
        r: n[i % len(n)] if n else 32 if r is None else max(8, round(r * args.duration)) for i, r in enumerate(rates)
    }
    base = args.url.rstrip("/")
    targets = [
        (m, args.endpoint[i % len(args.endpoint)], args.model_name or m)
        if args.endpoint
        else (m, f"{base}/predictions/{m}/1.0/v1/completions", args.model_name)
        for i, m in enumerate(args.model)
    ]
    key = read_key(args)
    return Plan(rates, counts, targets, {"Authorization": f"Bearer {key}"} if key else {}, base)


def _describe(args: argparse.Namespace, plan: Plan) -> str:
    if args.dataset:
        desc = f"{args.dataset}, output max_tokens from the file or U{list(args.output_len)}"
    else:
        desc = (
            f"synthetic token-id prompts, input U[{args.input_len[0]}, {args.input_len[1]}] tokens, output "
            f"U[{args.output_len[0]}, {args.output_len[1]}] tokens (max_tokens, ignore_eos, greedy), seed {args.seed}"
        )
    per_rate = (
        f"{'/'.join(map(str, args.num_requests))} requests" if args.num_requests else f"{args.duration:g} s of arrivals"
    )
    load_desc = (
        f"Poisson arrivals, {per_rate} per rate"
        if plan.rates != [None]
        else f"closed loop, {args.concurrency} clients, {plan.counts[None]} requests"
    )
    return f"{desc}; {load_desc}"


def _warm_up(args: argparse.Namespace, plan: Plan) -> bool:
    """First requests pay lazy initialisation; keep them out of the figures. `--warmup-load`
    also runs the streaming path under load first: TorchServe's JVM compiles it after thousands
    of chunks, and a 2-request warm-up left its JIT compiler threads on up to 0.15 of 2 cores
    during the measurement (docs/performance-log.md#reading-the-table-above-intel-xeon-with-amx-2026-12-04)."""
    for model, url, name in plan.targets:
        first = make_workload(args.warmup, args.seed + 1, (8, 16), (2, 4), args.token_range)
        load = make_workload(args.warmup_load, args.seed + 2, args.input_len, args.output_len, args.token_range)
        results = run_one(url, model, plan.headers, first, None, 1, 0, args.timeout, None, name)
        if args.warmup_load:
            results += run_one(url, model, plan.headers, load, None, args.concurrency or 1, 0, args.timeout, None, name)
        if failed := [r for r in results if r.error]:
            print(f"warm-up of {model}: {len(failed)} requests failed: {failed[0].error}", file=sys.stderr)
            return False
    return True


def _run_all(args: argparse.Namespace, plan: Plan, specs: list[Spec]) -> tuple[list[Result], list[dict]]:
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(plan.counts.values()) * len(plan.targets), unit="req", dynamic_ncols=True)
    results: list[Result] = []
    summaries = []
    probe = CpuProbe(args.cpu_of) if args.cpu_of is not None else None
    for rate in plan.rates:  # interleave systems per rate: drifting machine load hits both alike
        for model, url, name in plan.targets:
            n = plan.counts[rate]
            counts = engine_counts.settled(args.engine_metrics, 0) if args.engine_metrics else None
            before, t0 = (probe.snapshot() if probe else {}), time.perf_counter()
            res = run_one(
                url, model, plan.headers, specs[:n], rate, args.concurrency, args.seed, args.timeout, bar, name
            )
            results += res
            summaries.append(summarize(res, rate, args.concurrency))
            tokens = sum(r.output_tokens for r in res)
            if probe is not None:
                cpu = CpuProbe.delta(before, probe.snapshot(), tokens, time.perf_counter() - t0)
                summaries[-1]["cpu"] = cpu
                print(cpu_table(cpu), flush=True)
            if counts is not None:
                after = engine_counts.settled(args.engine_metrics, counts["orca_generation_tokens_total"] + tokens)
                summaries[-1]["engine"] = engine_counts.delta(counts, after)
                print(engine_counts.line(summaries[-1]["engine"]), flush=True)
                if probe is not None:
                    summaries[-1]["run_delay"] = _run_delay(args, summaries[-1])
    if bar is not None:
        bar.close()
    return results, summaries


def _run_delay(args: argparse.Namespace, summary: dict) -> dict:
    """The compute threads' run delay and the neighbours' CPU (run_delay.py); against the
    `--against-loop` run, the step-time excess and its amplification."""
    got = {"http": run_delay.summary(summary["cpu"], summary["engine"]["steps"])}
    if args.against_loop:
        runs = run_delay.loop_runs(args.against_loop)
        got["against"] = run_delay.against(got["http"], runs["loop"], runs.get("engine")) if "loop" in runs else {}
        got["loop"], got["engine"] = runs.get("loop"), runs.get("engine")
    print(run_delay.lines(got["http"], got.get("against")), flush=True)
    return got


def run(args: argparse.Namespace) -> dict:
    if not args.start_torchserve:
        return _measure(args)
    with serve_local.started(args) as (url, key, sid):
        args.url, args.key = url, key or "none"
        args.cpu_of = sid if args.cpu_of is None else args.cpu_of
        return _measure(args)


def _measure(args: argparse.Namespace) -> dict:
    plan = _plan(args)
    specs = make_workload(
        max(plan.counts.values()), args.seed, args.input_len, args.output_len, args.token_range, args.dataset
    )
    if not _warm_up(args, plan):
        return {"error": "warm-up failed", "exit_code": 2}
    all_results, summaries = _run_all(args, plan, specs)
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"
    report = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": os.environ.get("SERVE_BENCH_COMMAND") or command_line(cli.ARGV),
        "machine": machine(),
        "url": plan.base,
        "endpoints": {model: url for model, url, _ in plan.targets},
        "model_name": args.model_name,
        "systems": args.model,
        "workload": {
            "description": _describe(args, plan),
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "dataset": args.dataset,
            "seed": args.seed,
            "rates": plan.rates,
            "num_requests": [plan.counts[r] for r in plan.rates],
            "concurrency": args.concurrency,
            "duration_s": args.duration,
        },
        "summaries": summaries,
        "verdict": verdict(summaries, args.model[0], args.model[1]) if len(args.model) >= 2 else None,
        "plot": plot_path,
        "requests": [asdict(r) for r in all_results],
    }
    plot(report, plot_path)
    text = markdown(report)
    if args.update_doc:
        update_doc(args.update_doc, text, BEGIN, END)
    print(text)
    errors = sum(s["errors"] for s in summaries)
    for r in [r for r in all_results if r.error][:5]:
        print(f"error: {r.system} #{r.index}: {r.error}", file=sys.stderr)
    report["exit_code"] = 1 if errors else 0
    return report  # written to args.out by the CLI

"""Fair share between tenants over a real TorchServe (docs/fair-share.md "Fair share between tenants
(VTC)"): does a flood from one tenant delay another tenant's requests, under `fcfs` and `fair`?

    orcaserve-bench fair                     # about 8 min on 2 CPU cores
    orcaserve-bench fair --flood-clients 96 --out benchmarks/results/fairness-96.json \\
        --plot /tmp/fairness-96.png                   # the issue's shape: 96 flooding clients
    orcaserve-bench fair --phase-seconds 15 --flood-clients 6 --max-num-seqs 4 \\
        --out /tmp/fair.json --plot /tmp/fair.png     # smoke

One TorchServe (free loopback ports, token auth, Prometheus metrics) with three archives of the
default model (SmolLM2-135M) that differ only in policy: `fcfs`, `fair`, `fair` with tenant
weights A:B = 2:1; `tenant_header` X-Tenant-Id, `max_num_seqs` lowered to match the scaled-down
client counts; `max_waiting_requests` and TorchServe's job queue raised to the most clients a phase
has, so that no request is refused (503) for lack of room. Phases, each `--phase-seconds` long,
every client closed-loop (a new streamed request as soon as its last one ends):
  1. B alone: one client of tenant B on the `fair` archive (one tenant: the same order as fcfs);
  2. fcfs: tenant A floods with `--flood-clients` clients (more than `max_num_seqs`), B as above;
  3. fair: the same on the `fair` archive;
  4. fair 2:1: A floods as before and B floods with half as many clients, weights A 2, B 1, so
     both are backlogged and the token share should be 2:1.
Reported per phase: B's p50/p99 TTFT and end-to-end latency, output tokens/s in all, each
tenant's token share over time (a request's tokens spread evenly over its decode time), and the
engine's own per-tenant counters scraped from `:8082/metrics`; then, the server stopped, the bound
on B's latency ratios: a decode step of 1 row against `max_num_seqs` rows in this process
(fairness_report.step_bound; `--no-step-bound` skips it). JSON (`--out`) and PNG (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

from orcaserve.bench import result
from orcaserve.bench.fairness_report import engine_view, goals, markdown, plot, scrape, step_bound, summarize
from orcaserve.bench.harness import TorchServe
from orcaserve.bench.serve_client import send
from orcaserve.bench.serve_report import machine
from orcaserve.bench.serve_workload import _range, make_workload

REPO = Path(__file__).resolve().parents[1]

HEADER = "X-Tenant-Id"
ARCHIVES: dict[str, dict] = {"fcfs": {"scheduling_policy": "fcfs"}, "fair": {"scheduling_policy": "fair"}}
ARCHIVES["fair21"] = {"scheduling_policy": "fair", "tenant_weights": {"A": 2, "B": 1}}


def phases(args) -> list[dict]:
    flood = args.flood_clients
    return [
        {"name": "B alone", "model": "fair", "clients": {"B": 1}},
        {"name": "fcfs", "model": "fcfs", "clients": {"A": flood, "B": 1}},
        {"name": "fair", "model": "fair", "clients": {"A": flood, "B": 1}},
        {"name": "fair 2:1", "model": "fair21", "clients": {"A": flood, "B": max(1, flood // 2)}},
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase-seconds", type=float, default=75.0, help="length of each phase")
    p.add_argument("--flood-clients", type=int, default=24, help="tenant A's closed-loop clients")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--input-len", type=_range, default="32:128", help="prompt tokens A:B, uniform, both tenants")
    p.add_argument("--output-len", type=_range, default="32:128", help="max_tokens A:B, uniform, both tenants")
    p.add_argument("--bin-seconds", type=float, default=5.0, help="width of the token-share bins")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more handler overrides")
    p.add_argument("--workdir", default=None, help="TorchServe's scratch directory (default: a temporary one)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/fairness.json"))
    p.add_argument("--plot", default=str(REPO / "docs/fairness.png"))
    p.add_argument("--no-step-bound", action="store_true", help="skip the decode-step measurement after the phases")


def start_server(args, work: Path) -> TorchServe:
    import yaml

    from orcaserve.handler.archive import build

    store = work / "model-store"
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    # Room for every client's request at once (the 2:1 phase has the most), in the worker and in
    # TorchServe's job queue (100 by default), so that a flood is queued, never refused.
    clients = max(sum(p["clients"].values()) for p in phases(args))
    limits = {"max_waiting_requests": max(64, clients)}
    for name, policy in ARCHIVES.items():
        overrides = {"max_num_seqs": args.max_num_seqs, "tenant_header": HEADER, **limits, **policy, **extra}
        build("default", f"orca-{name}", str(store), fmt="no-archive", overrides=overrides, force=True)
    server = TorchServe(work / "ts", store, extra_config={"job_queue_size": str(max(100, 2 * clients))}).start()
    try:
        for name in ARCHIVES:
            started = time.time()
            server.register(f"orca-{name}")
            print(f"registered orca-{name} in {time.time() - started:.0f} s", flush=True)
    except BaseException:  # Ctrl-C too: the server's processes would outlive the script
        server.stop()
        raise
    return server


def run_phase(server: TorchServe, phase: dict, args, seed: int) -> tuple[list[dict], float]:
    """Every client of every tenant in closed loop until the phase's end: the requests they sent,
    and when the phase began."""
    url = server.url(f"/predictions/orca-{phase['model']}/1.0/v1/completions")
    records: list[dict] = []
    lock = threading.Lock()
    lengths = (args.input_len, args.output_len)
    # Each client's own requests, made before the clock starts (more than a phase sends). Their
    # lengths are the same in every phase, so B's latencies compare; their tokens are the phase's
    # own, so no phase finds another's prompts in the prefix cache (B alone and fair share a worker).
    clients = [(tenant, k) for tenant, n in sorted(phase["clients"].items()) for k in range(n)]
    work = {}
    for tenant, k in clients:
        stream = args.seed * 1000 + (500 if tenant == "B" else 0) + k
        specs = make_workload(400, stream, *lengths, (1000, 40000))
        tokens = random.Random(f"{seed}/{stream}")
        for spec in specs:
            spec.prompt = [tokens.randrange(1000, 40000) for _ in range(spec.input_len)]
        work[(tenant, k)] = specs
    start = time.time()
    deadline = start + args.phase_seconds

    def client(tenant: str, k: int) -> None:
        headers = {**server.auth(), HEADER: tenant}
        for spec in work[(tenant, k)]:
            if time.time() >= deadline:
                return
            r = send(url, headers, spec, tenant, None, 600.0)
            row = {"tenant": tenant, "client": k, "sent": r.sent, "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot}
            row.update(output_tokens=r.output_tokens, input_len=r.input_len, error=r.error)
            with lock:
                records.append(row)

    threads = [threading.Thread(target=client, args=c, daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, start


def sample_metrics(server: TorchServe, every: float, stop: threading.Event, into: list) -> None:
    """The engine's per-tenant counters every `every` seconds, until `stop` (one more after it)."""
    while True:
        into.append((time.time(), scrape(server)))
        if stop.wait(every):
            break


def warm_up(server: TorchServe) -> None:
    """First requests pay lazy initialisation and the frontend's JIT: keep them out of the figures."""
    for name in ARCHIVES:
        url = server.url(f"/predictions/orca-{name}/1.0/v1/completions")
        headers = {**server.auth(), HEADER: "warm-up"}
        specs = make_workload(8, 99, (8, 64), (4, 16), (1000, 40000))
        threads = [threading.Thread(target=send, args=(url, headers, s, name, None, 300.0)) for s in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="orcaserve-fairness-"))
    server = start_server(args, work)
    results = []
    try:
        warm_up(server)
        for i, phase in enumerate(phases(args)):
            print(f"== phase {phase['name']}: {phase['clients']} on orca-{phase['model']}", flush=True)
            samples: list = []
            stop = threading.Event()
            sampler = threading.Thread(target=sample_metrics, args=(server, args.bin_seconds, stop, samples))
            load = os.getloadavg()[0]
            sampler.start()
            records, start = run_phase(server, phase, args, args.seed + i)
            time.sleep(1.5)  # the worker emits its counters at most every 0.25 s while busy
            stop.set()
            sampler.join()
            summary = summarize(phase, records, start, args.phase_seconds, args.bin_seconds)
            summary["engine"] = engine_view(samples, f"orca-{phase['model']}")
            summary["load_average"] = {"start": load, "end": os.getloadavg()[0]}
            results.append(summary)
            print(json.dumps({k: summary[k] for k in ("name", "B", "throughput_tok_s", "share")}), flush=True)
    finally:
        server.stop()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "workdir")},
        "phases": results,
        "step_bound": None,
    }
    result.write(args.out, report)  # kept if what follows fails
    if not args.no_step_bound:
        print("== decode step, 1 row against max_num_seqs rows (the server stopped)", flush=True)
        report["step_bound"] = step_bound(args.max_num_seqs)
        print(json.dumps(report["step_bound"]), flush=True)
    report["goals"] = goals(results, report["step_bound"])
    plot(results, args.plot, args.bin_seconds)
    print(markdown(report))
    return report  # written to args.out by the CLI

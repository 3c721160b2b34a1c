"""Fair share between tenants over a real TorchServe (docs/fair-share.md "Fair share between tenants
(VTC)"): does a flood from one tenant delay another tenant's requests, under `fcfs` and `fair`?

    orcaserve-bench fair                     # about 8 min on 2 CPU cores
    orcaserve-bench fair --phase-seconds 15 --flood-clients 6 --max-num-seqs 4 \\
        --out /tmp/fair.json --plot /tmp/fair.png     # smoke

One TorchServe with three archives of the default model that differ only in policy: `fcfs`,
`fair`, `fair` with tenant weights A:B = 2:1 (`tenant_header` X-Tenant-Id; room for every
client's request, so none is refused). Phases of `--phase-seconds`, every client closed-loop:
B alone (one client); fcfs and fair with A flooding (`--flood-clients`) beside B's one client;
fair 2:1 with B flooding too (half as many clients), so the token share should be 2:1. Reported
per phase: B's TTFT and end-to-end percentiles, output tokens/s, each tenant's token share over
time; then, the server stopped, the bound on B's latency ratios: a decode step of 1 row against
`max_num_seqs` rows (fairness_report.step_bound; `--no-step-bound` skips it).
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
from orcaserve.bench.fair.report import goals, markdown, plot, step_bound, summarize
from orcaserve.bench.serve.client import Result, clients, run_one, send
from orcaserve.bench.serve.harness import TorchServe
from orcaserve.bench.serve.local import orcaserve_archive, torchserve
from orcaserve.bench.serve.workload import make_workload

REPO = Path(__file__).resolve().parents[2]

HEADER = "X-Tenant-Id"
ARCHIVES: dict[str, dict] = {"fcfs": {"scheduling_policy": "fcfs"}, "fair": {"scheduling_policy": "fair"}}
ARCHIVES["fair21"] = {"scheduling_policy": "fair", "tenant_weights": {"A": 2, "B": 1}}
LENGTHS = ((32, 128), (32, 128))  # prompt and output tokens, uniform, both tenants
BIN_S = 5.0  # width of the token-share bins


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "docs/results/fairness.json"))
    p.add_argument("--plot", default=str(REPO / "docs/fairness.png"))
    p.add_argument("--no-step-bound", action="store_true", help="skip the decode-step measurement after the phases")


def run_phase(server: TorchServe, phase: dict, args, seed: int) -> tuple[list[Result], float]:
    """Every client of every tenant in closed loop until the phase's end: the requests they sent,
    and when the phase began."""
    url = server.url(f"/predictions/orca-{phase['model']}/1.0/v1/completions")
    # Each client's own requests, made before the clock starts (more than a phase sends). Their
    # lengths are the same in every phase, so B's latencies compare; their tokens are the phase's
    # own, so no phase finds another's prompts in the prefix cache (B alone and fair share a worker).
    each = [(tenant, k) for tenant, n in sorted(phase["clients"].items()) for k in range(n)]
    tenants = [tenant for tenant, _ in each]
    work = []
    for tenant, k in each:
        stream = args.seed * 1000 + (500 if tenant == "B" else 0) + k
        specs = make_workload(400, stream, *LENGTHS, (1000, 40000))
        tokens = random.Random(f"{seed}/{stream}")
        for spec in specs:
            spec.prompt = [tokens.randrange(1000, 40000) for _ in range(spec.input_len)]
        work.append(iter(specs))
    records: list[Result] = []
    lock = threading.Lock()

    def one(k: int, spec) -> None:
        r = send(url, {**server.auth(), HEADER: tenants[k]}, spec, tenants[k], None, 600.0)
        with lock:
            records.append(r)

    start = time.time()
    for t in clients(len(tenants), lambda k: next(work[k], None), one, until=start + args.phase_seconds):
        t.join()
    return records, start


def warm_up(server: TorchServe) -> None:
    """First requests pay lazy initialisation and the frontend's JIT: keep them out of the figures."""
    for name in ARCHIVES:
        url = server.url(f"/predictions/orca-{name}/1.0/v1/completions")
        specs = make_workload(8, 99, (8, 64), (4, 16), (1000, 40000))
        run_one(url, name, {**server.auth(), HEADER: "warm-up"}, specs, None, len(specs), 0, 300.0)


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="orcaserve-fairness-"))
    # Room for every client's request at once (the 2:1 phase has the most), in the worker and in
    # TorchServe's job queue (100 by default), so that a flood is queued, never refused.
    most = max(sum(p["clients"].values()) for p in phases(args))
    limits = {"max_num_seqs": args.max_num_seqs, "tenant_header": HEADER, "max_waiting_requests": max(64, most)}
    names = [orcaserve_archive(work, f"orca-{name}", {**limits, **policy}) for name, policy in ARCHIVES.items()]
    results = []
    with torchserve(work, names, queue=max(100, 2 * most)) as server:
        warm_up(server)
        for i, phase in enumerate(phases(args)):
            print(f"== phase {phase['name']}: {phase['clients']} on orca-{phase['model']}", flush=True)
            load = os.getloadavg()[0]
            records, start = run_phase(server, phase, args, args.seed + i)
            summary = summarize(phase, records, start, args.phase_seconds, BIN_S)
            summary["load_average"] = {"start": load, "end": os.getloadavg()[0]}
            results.append(summary)
            print(json.dumps({k: summary[k] for k in ("name", "B", "throughput_tok_s", "share")}), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": result.machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "phases": results,
        "step_bound": None,
    }
    result.write(args.out, report)  # kept if what follows fails
    if not args.no_step_bound:
        print("== decode step, 1 row against max_num_seqs rows (the server stopped)", flush=True)
        report["step_bound"] = step_bound(args.max_num_seqs)
        print(json.dumps(report["step_bound"]), flush=True)
    report["goals"] = goals(results, report["step_bound"])
    plot(results, args.plot, BIN_S)
    print(markdown(report))
    return report  # written to args.out by the CLI

"""What a TorchServe worker costs in memory (docs/deploy.md, "Several workers on one host").

    .venv/bin/python benchmarks/deploy_memory.py [--workers 2] [--set kv_cache_memory=256MiB]

Starts one TorchServe with the default archive (model-config.yaml's defaults unless --set), then
with 1, 2, ... workers, each after a few greedy requests, prints per process: RSS, USS (pages only
it holds) and PSS (its share of pages it shares, e.g. torch's libraries between workers), for the
frontend JVM, each worker and each worker's supervisor; JSON to benchmarks/results/deploy-memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the TorchServe harness the end-to-end tests use

from torchserve_harness import TorchServe  # noqa: E402

from orcaserve.handler.archive import build  # noqa: E402

MIB = 1 << 20


def footprint(pid: int) -> dict[str, float]:
    info = psutil.Process(pid).memory_full_info()
    return {"rss_mib": info.rss / MIB, "uss_mib": info.uss / MIB, "pss_mib": info.pss / MIB}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def measure(ts: TorchServe, name: str) -> dict:
    """Every process of the server: the frontend, each worker and its supervisor (a child)."""
    workers = ts.worker_pids(name)
    # The frontend is the JVM that the `torchserve` launcher starts.
    [jvm] = [c.pid for c in psutil.Process(ts.proc.pid).children(recursive=True) if c.name() == "java"]
    out: dict = {"frontend": footprint(jvm), "workers": []}
    for pid in workers:
        children = [c.pid for c in psutil.Process(pid).children() if c.pid not in workers]
        out["workers"].append({"worker": footprint(pid), "supervisor": [footprint(c) for c in children]})
    return out


def warm(ts: TorchServe, name: str, requests_per_worker: int, workers: int) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}
    for _ in range(requests_per_worker * workers):
        r = requests.post(ts.url(f"/predictions/{name}/1.0/v1/completions"), json=body, headers=ts.auth(), timeout=300)
        r.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a handler key of the archive")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/deploy-memory.json"))
    args = p.parse_args(argv)
    overrides = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "model-store"
        build("default", "smollm2", str(store), overrides=overrides)
        with TorchServe(Path(tmp) / "work", store) as ts:
            ts.register("smollm2.mar")
            for n in range(1, args.workers + 1):
                if n > 1:
                    ts.scale("smollm2", n)
                warm(ts, "smollm2", 4, n)
                time.sleep(2)
                m = measure(ts, "smollm2")
                results.append({"num_workers": n, **m})
                for i, w in enumerate(m["workers"]):
                    sup = sum(s["pss_mib"] for s in w["supervisor"])
                    print(
                        f"{n} worker(s): worker {i} RSS {w['worker']['rss_mib']:.0f} MiB, USS "
                        f"{w['worker']['uss_mib']:.0f}, PSS {w['worker']['pss_mib']:.0f}; supervisor PSS {sup:.0f}"
                    )
                jvm = m["frontend"]
                print(f"{n} worker(s): frontend (JVM) RSS {jvm['rss_mib']:.0f} MiB, PSS {jvm['pss_mib']:.0f}")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "commit": commit.stdout.strip(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / (1 << 30):.1f} GiB",
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "overrides": overrides,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

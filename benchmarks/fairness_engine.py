"""benchmarks/fairness.py's scenario inside one process, robust to a busy machine: three engines
(tenant B alone, B beside A's flood under `fcfs`, the same under `fair`) take turns of 25 steps,
and each is timed by its own steps only, so a neighbour's load falls on all three alike.

    python benchmarks/fairness_engine.py [--seconds 240] [--threads 1] [--json out.json]

Tenant A keeps `--flood-clients` requests in flight (a new one the moment one finishes), B one,
its next added `--b-think-steps` steps after its last ends (1: as over HTTP, where A's clients
have refilled the freed seat by the time B's next request arrives; 0: at once, into that seat);
prompts U[32, 128] random tokens, outputs U[32, 128] (ignore_eos, greedy), `max_num_seqs` 16.
B's TTFT and end-to-end latency are engine seconds from its `add_request` to its first token and
to its end (no HTTP, no tokenizer). One torch thread by default: with two, a process beside them
on a 2-core machine leaves OpenMP threads spinning for each other and a step 10-30x slower.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.model.loader import default_model_path


class Run:
    """One engine with its closed-loop clients and its own clock (the sum of its steps)."""

    def __init__(self, policy: str, flood: int, max_num_seqs: int, seed: int, think: int = 1) -> None:
        self.engine = Engine.from_pretrained(
            default_model_path(), max_num_seqs=max_num_seqs, scheduling_policy=policy, kv_cache_memory=256 << 20
        )
        self.rng = random.Random(seed)
        self.clock = 0.0
        self.tokens = self.count = 0
        self.open: dict[str, list] = {}  # id -> [tenant, added at, first token at]
        self.b: list[tuple[float, float]] = []  # B's (TTFT, e2e)
        self.think = think
        self.b_due: int | None = None  # steps until B's next request is added (then 0)
        for _ in range(flood):
            self.add("A")
        self.add("B")

    def add(self, tenant: str) -> None:
        prompt = [self.rng.randrange(1000, 40000) for _ in range(self.rng.randint(32, 128))]
        params = SamplingParams(temperature=0, max_tokens=self.rng.randint(32, 128), ignore_eos=True)
        rid = f"{tenant}{self.count}"
        self.count += 1
        self.engine.add_request(rid, prompt, params, tenant=tenant)
        self.open[rid] = [tenant, self.clock, None]

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.b_due is not None:
                self.b_due -= 1
                if self.b_due <= 0:
                    self.b_due = None
                    self.add("B")
            start = time.perf_counter()
            outputs = self.engine.step()
            self.clock += time.perf_counter() - start
            for out in outputs:
                self.tokens += len(out.new_token_ids)
                entry = self.open[out.request_id]
                entry[2] = self.clock if entry[2] is None else entry[2]
                if out.finished:
                    tenant, added, first = self.open.pop(out.request_id)
                    if tenant == "B":
                        self.b.append((first - added, self.clock - added))
                    if tenant == "B" and self.think:
                        self.b_due = self.think + 1  # counted down before each step: none in between
                    else:
                        self.add(tenant)

    def summary(self, name: str) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))], 3) if xs else None

        ttft, e2e = [t for t, _ in self.b], [e for _, e in self.b]
        return {
            "name": name,
            "B_requests": len(self.b),
            "B_ttft_p50": pct(ttft, 50),
            "B_ttft_p99": pct(ttft, 99),
            "B_e2e_p50": pct(e2e, 50),
            "B_e2e_p99": pct(e2e, 99),
            "output_tok_s": round(self.tokens / self.clock, 1),
            "engine_seconds": round(self.clock, 1),
            "steps": self.engine.stats.num_steps,
            "suspensions": self.engine.scheduler.num_suspensions,
            "preemptions": self.engine.scheduler.num_preemptions,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="wall time for all three together")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flood-clients", type=int, default=24)
    p.add_argument("--b-think-steps", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runs = {
        "B alone": Run("fair", 0, args.max_num_seqs, 0, args.b_think_steps),
        "fcfs": Run("fcfs", args.flood_clients, args.max_num_seqs, 0, args.b_think_steps),
        "fair": Run("fair", args.flood_clients, args.max_num_seqs, 0, args.b_think_steps),
    }
    deadline = time.time() + args.seconds
    while time.time() < deadline:
        for run in runs.values():
            run.steps(25)
    rows = [run.summary(name) for name, run in runs.items()]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"settings": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""Latency targets over HTTP: `orcaserve-bench slo`'s two-class workload driven through real
servers, one after the other: orcaserve inside TorchServe with its classes (`slo_classes`, the
class header) and vLLM's OpenAI server with its priority policy (docs/latency-targets.md,
"Over HTTP").

    orcaserve-bench slo-http [--systems orcaserve,vllm] [--seconds 40] [--rate 0.5] [--flood 4]
                             [--plain] [--policy fair] [--out out.json]

The targets are derived once, from orcaserve's step of the flood's decodes measured in this
process first (as `slo` does; `--tpot-ms`/`--ttft-ms` give them instead), printed, and are the
same numbers for every system. Each system gets the very same requests: streamed completions of
token-id prompts with `ignore_eos`, interactive ones (`--short` tokens in, `--short-out` out) at
Poisson arrivals of `--rate` per second over `--seconds`, beside `--flood` closed-loop clients
sending `--long`-token prompts (`--long-out` out) until the window ends. orcaserve: the
interactive requests carry `X-Slo-Class: interactive`, the flood's `batch` (a class without
targets); under `--policy fair` they carry a tenant header instead, and `tenant_slo_class` gives
the interactive tenant its class. vLLM (`--scheduling-policy priority`): `priority` 0 for the
interactive requests, 1 for the flood's (lower is served first). `--plain` also runs each server
without the classes (orcaserve: no header; vLLM: every `priority` 0), judged by the same targets.
Reported per run: interactive attainment and goodput (requests per second meeting both targets,
TPOT per request = (e2e - TTFT) / (output tokens - 1)), the flood's completed requests per
second (no targets: each counts), TTFT/TPOT percentiles, output tokens per second.

Needs benchmarks/peers/setup_vllm.sh for vLLM (and converts the model for it once).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orcaserve.bench.serve_client import Result, send
from orcaserve.bench.serve_workload import Spec
from orcaserve.bench.slo_servers import SERVERS, Server


def token_range(text: str) -> tuple[int, int]:
    """`A:B` -> the prompts' token ids, drawn from [A, B)."""
    a, _, b = text.partition(":")
    if not (a.isdigit() and b.isdigit() and int(a) < int(b)):
        raise argparse.ArgumentTypeError(f"want A:B with A < B, got {text!r}")
    return int(a), int(b)


class Workload:
    """The requests both systems get: the interactive arrivals and prompts, and the flood's
    prompts in the order its clients take them."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        rng = random.Random(seed)
        self.args = args
        self.arrivals: list[float] = []  # offsets from the start, s
        t = rng.expovariate(args.rate)
        while t < args.seconds:
            self.arrivals.append(t)
            t += rng.expovariate(args.rate)
        self.interactive = [self._spec(rng, i, args.short, args.short_out) for i in range(len(self.arrivals))]
        self.rng = rng  # the flood's prompts, drawn as its clients ask
        self.lock = threading.Lock()
        self.flood_count = 0

    def _spec(self, rng: random.Random, index: int, n: int, out: int) -> Spec:
        return Spec(index, [rng.randrange(*self.args.token_range) for _ in range(n)], n, out)

    def next_flood(self) -> Spec:
        with self.lock:
            self.flood_count += 1
            return self._spec(self.rng, 100000 + self.flood_count, self.args.long, self.args.long_out)


def drive(server: Server, args: argparse.Namespace, classes: bool, seed: int = 1) -> dict:
    """One run against a started server: {"records": results by class, "duration_s": seconds from
    the first send to the last answer}."""
    work = Workload(args, seed)
    start = time.time()
    end = start + args.seconds
    records: dict[str, list[Result]] = {"interactive": [], "batch": []}
    lock = threading.Lock()

    def one(cls: str, spec: Spec) -> None:
        headers, extra = server.request_for(cls, classes)
        res = send(server.url, headers, spec, cls, None, args.timeout, server.model_name, extra)
        with lock:
            records[cls].append(res)

    def flood_client() -> None:
        while time.time() < end:
            one("batch", work.next_flood())

    flood = [threading.Thread(target=flood_client, daemon=True) for _ in range(args.flood)]
    for t in flood:
        t.start()
    with ThreadPoolExecutor(max_workers=max(1, min(len(work.interactive), 256))) as pool:
        for spec, offset in zip(work.interactive, work.arrivals):
            delay = start + offset - time.time()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, "interactive", spec)
    for t in flood:
        t.join()
    return {"records": records, "duration_s": time.time() - start}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))], 1)


def summarize(run: dict, targets: dict[str, float], seconds: float) -> dict:
    """Per class figures of one run; the interactive class judged against `targets` (seconds)."""
    out: dict = {}
    tokens = 0
    for cls, rs in run["records"].items():
        ok = [r for r in rs if r.error is None and r.ttft is not None]
        tokens += sum(r.output_tokens for r in ok)
        row: dict = {"requests": len(rs), "errors": len(rs) - len(ok)}
        if cls == "interactive":
            good = [r for r in ok if r.ttft <= targets["ttft"] and (r.tpot or 0.0) <= targets["tpot"]]
            row["attainment"] = round(len(good) / len(rs), 3) if rs else None
            row["ttft_attainment"] = round(sum(r.ttft <= targets["ttft"] for r in ok) / len(rs), 3) if rs else None
            row["tpot_attainment"] = (
                round(sum((r.tpot or 0.0) <= targets["tpot"] for r in ok) / len(rs), 3) if rs else None
            )
            row["goodput_rps"] = round(len(good) / seconds, 3)
        else:
            row["completed_rps"] = round(len(ok) / seconds, 3)
        ttfts, tpots = [r.ttft for r in ok], [r.tpot for r in ok if r.tpot is not None]
        row.update(
            p50_ttft_ms=_pct(ttfts, 0.5),
            p99_ttft_ms=_pct(ttfts, 0.99),
            p50_tpot_ms=_pct(tpots, 0.5),
            p99_tpot_ms=_pct(tpots, 0.99),
            max_tpot_ms=_pct(tpots, 1.0),
        )
        out[cls] = row
    out["total_goodput_rps"] = round(out["interactive"]["goodput_rps"] + out["batch"]["completed_rps"], 3)
    out["output_tokens_per_s"] = round(tokens / run["duration_s"], 2)
    out["duration_s"] = round(run["duration_s"], 1)
    return out


def derive_targets(args: argparse.Namespace) -> dict:
    """The targets in ms: given, or multiples of orcaserve's step of the flood's decodes alone,
    measured in this process (the engine freed before any server starts)."""
    result: dict = {}
    if args.tpot_ms is None or args.ttft_ms is None:
        import gc

        from orcaserve.bench.slo import decode_step
        from orcaserve.bench.slo_servers import ENGINE_ARGS
        from orcaserve.scheduler import Engine, default_model_path

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        engine = Engine.from_pretrained(default_model_path(), **ENGINE_ARGS, enable_prefix_caching=False)
        step = decode_step(engine, args)
        del engine
        gc.collect()
        result["decode_step_ms"] = round(1000 * step, 2)
    tpot = args.tpot_ms or round(result["decode_step_ms"] * args.tpot_x, 1)
    ttft = args.ttft_ms or round(result["decode_step_ms"] * args.ttft_x, 1)
    result["targets"] = {"ttft_ms": ttft, "tpot_ms": tpot}
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orcaserve.bench.slo import add_arguments as slo_arguments

    slo_arguments(parser)  # the workload's and the targets' options, the same meaning
    parser.set_defaults(rate=0.5, flood=4, sweep="")
    parser.add_argument(
        "--token-range", type=token_range, default=(100, 49152), help="prompt ids from [A, B) (SmolLM2's, no specials)"
    )
    parser.add_argument("--systems", default="orcaserve,vllm", help="which servers, in this order")
    parser.add_argument("--plain", action="store_true", help="also run each server without the classes")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of unrecorded load per server first")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout, s")
    parser.add_argument("--work", default=None, help="scratch folder for servers' logs (default: a new temp dir)")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a server to come up")


def run(args: argparse.Namespace) -> dict:
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SERVERS):
        raise SystemExit(f"slo-http: --systems: choose from {','.join(SERVERS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="orcaserve-slo-http."))
    work.mkdir(parents=True, exist_ok=True)
    result = derive_targets(args)
    t = result["targets"]
    targets = {"ttft": t["ttft_ms"] / 1000.0, "tpot": t["tpot_ms"] / 1000.0}
    print("targets", json.dumps(result), flush=True)
    result["workload"] = {
        k: getattr(args, k) for k in ("seconds", "rate", "flood", "short", "short_out", "long", "long_out", "policy")
    }
    result["work"] = str(work)
    for name in systems:
        with SERVERS[name](args, t, work) as server:
            warm = argparse.Namespace(**{**vars(args), "seconds": args.warmup})
            drive(server, warm, True, seed=2)  # unrecorded: JIT, caches, compiled paths
            for classes in [True, False] if args.plain else [True]:
                label = server.label(classes)
                row = summarize(drive(server, args, classes), targets, args.seconds)
                row["server"] = server.describe()
                result[label] = row
                print(label, json.dumps(row), flush=True)
    ours = result.get(SERVERS["orcaserve"].LABEL) if "orcaserve" in systems else None
    theirs = result.get(SERVERS["vllm"].LABEL) if "vllm" in systems else None
    if ours and theirs and theirs["interactive"]["goodput_rps"]:
        result["goodput_ratio"] = round(ours["interactive"]["goodput_rps"] / theirs["interactive"]["goodput_rps"], 2)
        print("interactive goodput, orcaserve / vLLM:", result["goodput_ratio"], flush=True)
    return result


if __name__ == "__main__":
    import sys

    from orcaserve.bench import cli

    sys.exit(cli.main(["slo-http", *sys.argv[1:]]))

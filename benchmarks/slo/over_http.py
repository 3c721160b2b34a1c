"""Latency targets over HTTP: `orcaserve-bench slo`'s two-class workload driven through real
servers, one after the other: orcaserve inside TorchServe with its classes (`slo_classes`, the
class header) and vLLM's OpenAI server with its priority policy (docs/latency-targets.md,
"Over HTTP", says what each system is sent and what is reported).

    orcaserve-bench slo-http [--systems orcaserve,vllm] [--seconds 40] [--rate 0.5] [--flood 4]
                             [--plain] [--policy fair] [--out out.json]

The targets are derived once, from orcaserve's step of the flood's decodes measured in this
process first (as `slo` does; `--tpot-ms`/`--ttft-ms` give them instead), and are the same for
every system; every system gets the very same requests. `--plain` also runs each server without
the classes, judged by the same targets. Needs benchmarks/peers/setup_vllm.sh for vLLM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from orcaserve.bench.serve.client import Result, arrivals, clients, send
from orcaserve.bench.serve.workload import Spec, _range
from orcaserve.bench.slo.servers import SERVERS, Server
from orcaserve.bench.slo.slo import by_class


def drive(server: Server, args: argparse.Namespace, classes: bool, seed: int = 1) -> dict:
    """One run against a started server: {"records": results by class, "duration_s": seconds from
    the first send to the last answer}. Every system gets the same requests: the interactive
    arrivals and prompts, and the flood's prompts in the order its clients take them."""
    rng = random.Random(seed)
    offsets = list(
        itertools.takewhile(
            lambda t: t < args.seconds, itertools.accumulate(rng.expovariate(args.rate) for _ in itertools.count())
        )
    )
    ids = lambda n: [rng.randrange(*args.token_range) for _ in range(n)]  # noqa: E731
    interactive = [Spec(i, ids(args.short), args.short, args.short_out) for i in range(len(offsets))]
    records: dict[str, list[Result]] = {"interactive": [], "batch": []}
    flood = itertools.count(100001)
    lock = threading.Lock()

    def one(cls: str, spec: Spec) -> None:
        headers, extra = server.request_for(cls, classes)
        res = send(server.url, headers, spec, cls, None, args.timeout, server.model_name, extra)
        with lock:
            records[cls].append(res)

    def take(_: int) -> Spec:
        with lock:
            return Spec(next(flood), ids(args.long), args.long, args.long_out)

    start = time.time()
    threads = clients(args.flood, take, lambda _, spec: one("batch", spec), until=start + args.seconds)
    arrivals(interactive, offsets, lambda spec: one("interactive", spec))
    for t in threads:
        t.join()
    return {"records": records, "duration_s": time.time() - start}


def summarize(run: dict, targets: dict[str, float], seconds: float) -> dict:
    """Per class figures of one run (slo.by_class), the total goodput and output tokens/s."""
    out = by_class([r for rs in run["records"].values() for r in rs], targets, seconds)
    tokens = sum(r.output_tokens for rs in run["records"].values() for r in rs if r.error is None)
    out["total_goodput_rps"] = round(sum(row["goodput_rps"] for row in out.values()), 3)
    out["output_tokens_per_s"] = round(tokens / run["duration_s"], 2)
    out["duration_s"] = round(run["duration_s"], 1)
    return out


def derive_targets(args: argparse.Namespace) -> dict:
    """The targets in ms: given, or multiples of orcaserve's step of the flood's decodes alone,
    measured in this process (the engine freed before any server starts)."""
    result: dict = {}
    if args.tpot_ms is None or args.ttft_ms is None:
        import gc

        from orcaserve.bench.slo.slo import ENGINE_ARGS, decode_step
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
    from orcaserve.bench.slo.slo import add_arguments as slo_arguments

    slo_arguments(parser)  # the workload's and the targets' options, the same meaning
    parser.set_defaults(rate=0.5, flood=4, sweep="")
    parser.add_argument(
        "--token-range", type=_range, default=(100, 49152), help="prompt ids from [A, B) (SmolLM2's, no specials)"
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

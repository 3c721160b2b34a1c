"""Prefix caching: what it buys on shared prompts, what it costs without them, and whether its
timing tells one tenant about another.

    orcaserve-bench prefix --out docs/results/prefix_cache.json --plot docs/prefix_cache_probe.png

Runs the engine behind `EngineLoop` in this process (the handler's threading, no HTTP), each
request read by its own client thread, with SmolLM2 at the server's default dtype.

1. shared: N requests sharing one system prompt of ~600 tokens, each with a distinct short
   question, Poisson arrivals: p50/p90 TTFT and output tokens/s, caching on vs off.
2. unshared: N random prompts of U[16, 256] tokens, outputs U[8, 128] (offline.py's shape), all
   submitted at once: output tokens/s on vs off (the cost of hashing and offering every full
   block, with nothing to reuse).
3. probe: one request at a time on an idle engine. Tenant A sends a fresh 512-token prefix, then
   the same prefix (new suffix) is asked by A, by tenant B, and a never-seen prefix by A. TTFTs
   of each kind, compared with a two-sample Kolmogorov-Smirnov test: A's cached prefix must be
   clearly separable from an unseen one, B's must not be.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import threading
import time
from functools import partial

import torch

from orcaserve.bench.result import machine, pct, pyplot
from orcaserve.bench.serve.workload import poisson_offsets
from orcaserve.handler.openai.tenancy import derive_cache_salt
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.loader import load_model_and_tokenizer
from orcaserve.scheduler.serving.engine_loop import EngineLoop

TOKENS = (100, 40000)  # token ids drawn from here: plain vocabulary, no special tokens
SERVER_ARGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512}  # handler/model-config.yaml
SYSTEM_LEN, PREFIX_LEN, PROBE_SAMPLES, REPEATS = 600, 512, 40, 2  # on/off runs alternate REPEATS times


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D and its asymptotic p-value (no scipy here)."""
    a, b = sorted(a), sorted(b)
    d, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        x = min(a[i], b[j])
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        d = max(d, abs(i / len(a) - j / len(b)))
    n = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def run_stream(loop: EngineLoop, work: list[tuple[list[int], int, str | None]], offsets: list[float]) -> dict:
    """Submit `work` ((prompt ids, output tokens, salt)) at `offsets`; TTFT and throughput."""
    ttft: list[float] = [0.0] * len(work)
    done: list[int] = [0] * len(work)

    def client(i: int, start: float) -> None:
        prompt, n, salt = work[i]
        time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        sent = time.perf_counter()
        stream = loop.submit(
            EngineRequest(
                f"q{i}-{sent}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), cache_salt=salt
            )
        )
        for out in stream:
            if not ttft[i] and out.completion_tokens:
                ttft[i] = time.perf_counter() - sent
            done[i] = out.completion_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, start)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert done == [n for _, n, _ in work], "a request ended short"
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(done) / wall, 1),
        "ttft_p50_s": round(pct(ttft, 50), 3),
        "ttft_p90_s": round(pct(ttft, 90), 3),
    }


def probe(loop: EngineLoop, n: int, prefix_len: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(*TOKENS) for _ in range(k)]  # noqa: E731
    salt = {t: derive_cache_salt("X-Tenant-Id", {"X-Tenant-Id": t}, None) for t in ("A", "B")}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int], tenant: str) -> float:
        sent = time.perf_counter()
        for _ in loop.submit(EngineRequest(f"p{time.perf_counter_ns()}", prompt, params, cache_salt=salt[tenant])):
            pass
        return time.perf_counter() - sent

    times: dict[str, list[float]] = {"A, cached by A": [], "B, cached by A": [], "A, never seen": []}
    for _ in range(n):
        prefix = ids(prefix_len)
        ttft(prefix + ids(8), "A")  # A's first request puts the prefix in the cache
        kinds = list(times)
        rng.shuffle(kinds)  # no kind always runs first after the warm-up request
        for kind in kinds:
            prompt = ids(prefix_len) + ids(8) if kind == "A, never seen" else prefix + ids(8)
            times[kind].append(ttft(prompt, kind[0]))
    return times


def plot(times: dict[str, list[float]], tests: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, xs in times.items():
        xs = sorted(x * 1000 for x in xs)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=kind)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms), log scale")
    ax.set_ylabel("fraction of requests")
    ax.set_title(
        "Prefix-cache timing probe: " + "; ".join(f"{k}: D={v['D']:.2f}, p={v['p']:.1e}" for k, v in tests.items()),
        fontsize=8,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second of the shared workload")
    ap.add_argument("--dtype", default=None, help="default: the server's (bf16 where the CPU has it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None)


def run(args: argparse.Namespace) -> dict:
    model, tok = load_model_and_tokenizer(default_model_path(), torch.float32, torch.device("cpu"))
    rng = random.Random(args.seed)
    system = [rng.randrange(*TOKENS) for _ in range(SYSTEM_LEN)]
    shared: list[tuple[list[int], int, str | None]] = [
        (system + [rng.randrange(*TOKENS) for _ in range(rng.randint(8, 24))], rng.randint(16, 48), None)
        for _ in range(args.num_requests)
    ]
    unshared: list[tuple[list[int], int, str | None]] = [
        ([rng.randrange(*TOKENS) for _ in range(rng.randint(16, 256))], rng.randint(8, 128), None)
        for _ in range(args.num_requests)
    ]
    arrivals = poisson_offsets(args.num_requests, args.rate, args.seed)
    arrivals_unshared = [0.0] * args.num_requests  # all at once, as offline.py

    results: dict = {
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
        "runs": [],
    }
    for rep in range(REPEATS):
        for caching in (True, False) if rep % 2 == 0 else (False, True):
            build = partial(
                Engine.from_model,
                copy.deepcopy(model),
                tok,
                dtype=args.dtype,
                enable_prefix_caching=caching,
                **SERVER_ARGS,
            )
            loop = EngineLoop.launch(build)
            try:
                warm = [
                    loop.submit(
                        EngineRequest(
                            f"warm-up{i}", [rng.randrange(*TOKENS) for _ in range(300)], SamplingParams(max_tokens=8)
                        )
                    )
                    for i in range(4)
                ]
                for stream in warm:  # the first prefills and decodes of a shape pay for one-off set-up
                    for _ in stream:
                        pass
                run = {
                    "caching": caching,
                    "repeat": rep,
                    "dtype": str(loop.engine.dtype).removeprefix("torch."),
                    "shared": run_stream(loop, shared, arrivals),
                    "unshared": run_stream(loop, unshared, arrivals_unshared),
                }
                if caching and rep == 0:
                    times = probe(loop, PROBE_SAMPLES, PREFIX_LEN, args.seed)
                    uncached = times["A, never seen"]
                    tests = {
                        k: dict(zip(("D", "p"), ks_2samp(v, uncached)))
                        for k, v in times.items()
                        if k != "A, never seen"
                    }
                    results["probe"] = {
                        "ttft_median_ms": {k: round(1000 * statistics.median(v), 2) for k, v in times.items()},
                        "ks_vs_never_seen": tests,
                        "ttft_s": times,
                    }
                    if args.plot:
                        plot(times, tests, args.plot)
            finally:
                loop.shutdown()
            print(json.dumps(run), flush=True)
            results["runs"].append(run)

    def best(caching: bool, part: str, key: str, pick) -> float:
        return pick(r[part][key] for r in results["runs"] if r["caching"] is caching)

    on_tp, off_tp = best(True, "shared", "output_tok_s", max), best(False, "shared", "output_tok_s", max)
    on_ttft, off_ttft = best(True, "shared", "ttft_p50_s", min), best(False, "shared", "ttft_p50_s", min)
    un_on, un_off = best(True, "unshared", "output_tok_s", max), best(False, "unshared", "output_tok_s", max)
    results["summary"] = {
        "shared_ttft_p50_s": {"on": on_ttft, "off": off_ttft, "ratio": round(off_ttft / on_ttft, 2)},
        "shared_output_tok_s": {"on": on_tp, "off": off_tp, "ratio": round(on_tp / off_tp, 2)},
        "unshared_output_tok_s": {"on": un_on, "off": un_off, "change_pct": round(100 * (un_on / un_off - 1), 1)},
    }
    if "probe" in results:
        results["summary"]["probe"] = {k: v for k, v in results["probe"].items() if k != "ttft_s"}
    print(json.dumps(results["summary"], indent=1))
    return results

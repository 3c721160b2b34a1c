"""The reliability suites against a real TorchServe (docs/reliability.md).

`tests/e2e/test_reliability_e2e.py` runs short versions in `make test`; the long ones run as a script:

    .venv/bin/python tests/reliability_suites.py --fuzz 500 --soak-minutes 10 --out reliability.json
    .venv/bin/python tests/reliability_suites.py --suites soak --soak-minutes 25   # one suite

Each suite returns a dict of what it tried and what was lost; the script prints them as the table
of docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests
from fuzz_bodies import chats, completions  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from openai_http import CHAT, COMPLETIONS, PROMPTS, call, expected, metric, read_stream  # noqa: E402
from reliability_faults import kill_worker, sigterm_mid_stream  # noqa: E402
from reliability_server import (  # noqa: E402
    ENGINE_ARGS,
    MODEL,
    SERVING,
    offline_engine,
    rss_mib,
    serving_pid,
    start_server,
    wait_idle,
)

from orcaserve.bench.serve.harness import TorchServe  # noqa: E402
from orcaserve.handler.archive import build  # noqa: E402
from orcaserve.scheduler import Engine  # noqa: E402


# ---- fuzz ---------------------------------------------------------------------------------------
def draw_bodies(n: int, rng_seed: int = 0) -> list[tuple[str, object]]:
    """`n` (path, body) pairs from the fuzz strategies of both endpoints."""
    out: list[tuple[str, object]] = []

    @seed(rng_seed)
    @settings(
        max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.one_of(st.tuples(st.just(COMPLETIONS), completions), st.tuples(st.just(CHAT), chats)))
    def draw(pair):
        out.append(pair)

    draw()
    return out


def check_answer(resp: requests.Response, stream_asked: bool) -> str:
    """Classify one answer; raises AssertionError if it is not a 4xx JSON error or a sound 200."""
    if resp.status_code != 200:
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
        assert resp.json()["error"]["message"], resp.text[:300]
        return str(resp.status_code)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert stream_asked
        read_stream(resp)
    else:
        assert resp.json()["choices"], resp.text[:300]
    return "200"


def live_fuzz(ts: TorchServe, offline: Engine, n: int, model: str = MODEL) -> dict:
    """`n` fuzz bodies, 8 at a time, while 4 greedy streams run; the streams must stay exact."""
    bodies = draw_bodies(n)
    greedy = PROMPTS[:4]
    want = expected(offline, [("completions", p) for p in greedy], [48] * 4)
    outcomes: Counter = Counter()
    failures: list[str] = []

    def one(pair) -> None:
        path, body = pair
        try:
            data = json.dumps(body).encode()
        except (ValueError, RecursionError):
            return
        asked = isinstance(body, dict) and body.get("stream") is True
        try:  # the client waits longer than the server's deadline: a slow answer is not a lost one
            outcomes[check_answer(call(ts, model, path, data, stream=asked, timeout=300), asked)] += 1
        except Exception as e:  # noqa: BLE001 - every kind of failure is a finding
            failures.append(f"{type(e).__name__}: {str(e)[:300]} for {data[:200]!r}")

    def stream(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}
        return read_stream(call(ts, model, COMPLETIONS, body, stream=True))["text"]

    with ThreadPoolExecutor(4) as streams, ThreadPoolExecutor(8) as pool:
        texts = [streams.submit(stream, p) for p in greedy]
        list(pool.map(one, bodies))
        got = [t.result() for t in texts]
    mismatches = sum(g != w.text for g, w in zip(got, want))
    after = check_answer(call(ts, model, COMPLETIONS, {"prompt": "hi", "max_tokens": 4}), False)
    return {
        "bodies": len(bodies),
        "answers": dict(outcomes),
        "failures": failures,
        "stream_mismatches": mismatches,
        "served_after": after == "200",
    }


# ---- soak ---------------------------------------------------------------------------------------
def soak(ts: TorchServe, offline: Engine, clients: int, seconds: float, model: str = MODEL, rng_seed: int = 0) -> dict:
    """`clients` streaming clients for `seconds`: most run greedy requests checked against the
    offline engine, some hang up early, some carry short deadlines."""
    lengths = (8, 16, 32, 64)
    items = [(p, n) for p in PROMPTS for n in lengths]
    want = {
        item: out.text
        for item, out in zip(items, expected(offline, [("completions", p) for p, _ in items], [n for _, n in items]))
    }
    counts: Counter = Counter()
    failures: list[str] = []
    pid = serving_pid(ts, model)
    call(ts, model, COMPLETIONS, {"prompt": "warm up", "max_tokens": 8}).raise_for_status()
    rss_start = rss_mib(pid)
    proc = psutil.Process(pid)
    fds_start, threads_start = proc.num_fds(), proc.num_threads()
    start = time.time()
    stop_at = start + seconds
    timeline: list[tuple[float, float, int]] = []  # (seconds in, RSS MiB, requests done)

    def sample() -> None:  # a leak shows as a slope; one figure at each end cannot tell it from warm-up
        while time.time() < stop_at:
            done = counts["completed_exact"] + counts["cancelled"] + counts["server_deadline_partial"]
            timeline.append((round(time.time() - start, 1), round(rss_mib(pid), 1), done))
            time.sleep(min(30.0, max(1.0, seconds / 40)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def client(k: int) -> None:
        rng = random.Random(rng_seed * 1000 + k)
        while time.time() < stop_at:
            prompt, n = rng.choice(items)
            kind = rng.random()
            body = {
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": False,
                "stream": rng.random() < 0.75,
            }
            try:
                if kind < 0.15:  # hangs up after the first chunk
                    body["stream"] = True
                    resp = call(ts, model, COMPLETIONS, body, stream=True, timeout=120)
                    next(line for line in resp.iter_lines() if line)
                    resp.close()
                    counts["cancelled"] += 1
                elif kind < 0.25:  # a deadline that may pass before or during generation
                    body["timeout"] = rng.choice((0.05, 0.5, 2.0))
                    resp = call(ts, model, COMPLETIONS, body, stream=body["stream"], timeout=120)
                    if resp.status_code == 408:
                        counts["deadline_408"] += 1
                    else:
                        out = read_stream(resp) if body["stream"] else resp.json()["choices"][0]
                        assert out["finish_reason"] in ("stop", "length"), out  # a deadline reads "length"
                        assert want[(prompt, n)].startswith(out["text"]), (prompt, n, out["text"])
                        counts["deadline_partial" if out["text"] != want[(prompt, n)] else "deadline_met"] += 1
                else:
                    resp = call(ts, model, COMPLETIONS, body, stream=body["stream"], timeout=300)
                    if resp.status_code == 408:  # overloaded past the server's own deadline
                        counts["server_deadline_408"] += 1
                        continue
                    out = read_stream(resp) if body["stream"] else resp.json()["choices"][0]
                    if out["finish_reason"] == "length" and out["text"] != want[(prompt, n)]:  # the deadline
                        assert want[(prompt, n)].startswith(out["text"]), (prompt, n, out["text"])
                        counts["server_deadline_partial"] += 1
                        continue
                    assert out["text"] == want[(prompt, n)], (prompt, n, out["text"], want[(prompt, n)])
                    counts["completed_exact"] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(f"{type(e).__name__}: {str(e)[:300]}")

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    sampler.join()
    idle = wait_idle(ts, model)
    return {
        "clients": clients,
        "seconds": seconds,
        **dict(counts),
        "failures": failures,
        "kv_blocks_used_at_end": idle["kv_blocks_used"],
        "running_at_end": idle["running"],
        "rss_mib_start": round(rss_start, 1),
        "rss_mib_end": round(rss_mib(pid), 1),
        "rss_timeline": timeline,
        "fds_start": fds_start,
        "fds_end": proc.num_fds(),
        "threads_start": threads_start,
        "threads_end": proc.num_threads(),
    }


# ---- KV exhaustion --------------------------------------------------------------------------------
def kv_exhaustion(ts: TorchServe, offline: Engine, n: int = 12, model: str = "smollm2-kv") -> dict:
    """A second model with a 24-block cache (384 tokens) and `n` requests needing ~170 each."""
    store = ts.model_store
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2 fp32
    build(
        "default",
        model,
        str(store),
        fmt="default",
        force=True,
        # The cache seats about two requests at a time, so the last waits on most of the others before
        # its first token: a deadline far beyond that, on a loaded machine too.
        overrides={**ENGINE_ARGS, "kv_cache_memory": 24 * block_bytes, "max_num_seqs": 8, **SERVING}
        | {"default_timeout": 900},
    )
    ts.register(f"{model}.mar")
    try:
        prompts = [f"{PROMPTS[i % 16]} " + "and then " * (25 + 3 * i) for i in range(n)]
        want = expected(offline, [("completions", p) for p in prompts], [48] * n)

        def one(i: int) -> bool:
            body = {"prompt": prompts[i], "max_tokens": 48, "temperature": 0, "stream": i % 2 == 0}
            resp = call(ts, model, COMPLETIONS, body, stream=i % 2 == 0, timeout=600)
            text = read_stream(resp)["text"] if i % 2 == 0 else resp.json()["choices"][0]["text"]
            return text == want[i].text

        with ThreadPoolExecutor(n) as pool:
            exact = sum(pool.map(one, range(n)))
        idle = wait_idle(ts, model)
        preemptions = metric(ts.metrics(), "orca_preemptions_total", model)
    finally:
        ts.unregister(model)
    return {"requests": n, "exact": exact, "preemptions": preemptions, "kv_blocks_used_at_end": idle["kv_blocks_used"]}


# ---- client disconnect -----------------------------------------------------------------------------
def abandoned_stream(ts: TorchServe, max_tokens: int = 64, model: str = MODEL, timeout: float = 300.0) -> dict:
    """What a client that hangs up costs: the request runs on to `max_tokens` (or its deadline).
    Read from the engine's token counter, with nothing else running."""
    wait_idle(ts, model)
    before = metric(ts.metrics(), "orca_generation_tokens_total", model)
    body = {"prompt": "Count to one hundred:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    resp = call(ts, model, COMPLETIONS, body, stream=True)
    next(line for line in resp.iter_lines() if line)
    resp.close()
    hung_up = time.time()
    generated = 0.0
    while time.time() - hung_up < timeout:
        generated = metric(ts.metrics(), "orca_generation_tokens_total", model) - before
        if generated >= max_tokens:
            break
        time.sleep(0.25)
    ran_for = time.time() - hung_up
    idle = wait_idle(ts, model)
    return {
        "max_tokens": max_tokens,
        "tokens_generated_after_hangup": generated,
        "seconds_running_after_hangup": round(ran_for, 1),
        "kv_blocks_used_at_end": idle["kv_blocks_used"],
    }


# ---- oversized prompts --------------------------------------------------------------------------------
def oversized_prompts(ts: TorchServe, offline: Engine, n: int = 4, model: str = MODEL) -> dict:
    """`n` bodies just under the 1 MiB limit (random printable text, or that text in a chat of
    400 messages, alternately), sent at once while greedy streams run one after another. Each takes
    seconds to tokenize and is refused (400, too long); the streams must stay exact, and their
    largest gap between two chunks says whether the tokenizing stopped them."""
    rng = random.Random(0)
    alphabet = "".join(chr(c) for c in range(32, 127))
    text = "".join(rng.choice(alphabet) for _ in range(990_000))
    big = [
        (COMPLETIONS, {"prompt": text, "max_tokens": 4})
        if i % 2 == 0
        else (CHAT, {"messages": [{"role": "user", "content": text[k : k + 2450]} for k in range(0, 980_000, 2450)]})
        for i in range(n)
    ]
    want = expected(offline, [("completions", PROMPTS[0])], [48])[0].text
    body = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "stream": True}
    attack_over = threading.Event()
    streams: list[dict] = []

    def victim() -> None:
        while not attack_over.is_set():
            streams.append(read_stream(call(ts, model, COMPLETIONS, body, stream=True)))

    with ThreadPoolExecutor(1) as vpool, ThreadPoolExecutor(n) as pool:
        running = vpool.submit(victim)
        while not streams:  # a first stream done: the server is warm and streaming
            time.sleep(0.1)
        started = time.time()
        answers = list(pool.map(lambda pb: call(ts, model, pb[0], json.dumps(pb[1]).encode()), big))
        attack_s = time.time() - started
        attack_over.set()
        running.result()
    during = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:]) if started <= b <= started + attack_s]
    return {
        "bodies": [len(json.dumps(b).encode()) for _, b in big],
        "statuses": [r.status_code for r in answers],
        "params": [r.json()["error"].get("param") for r in answers if r.status_code != 200],
        "attack_s": round(attack_s, 2),
        "streams": len(streams),
        "stream_mismatches": sum(s["text"] != want for s in streams),
        "largest_gap_during_s": round(max(during, default=attack_s), 3),
    }


SUITES = ("fuzz", "soak", "kv_exhaustion", "abandoned_stream", "oversized_prompts", "sigkill", "loop_death", "sigterm")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fuzz", type=int, default=300, help="live fuzz bodies")
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--soak-clients", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--workdir", default=None, help="TorchServe's files and logs (default: a new temp dir, kept)")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from {','.join(SUITES)}")
    args = p.parse_args(argv)
    chosen = args.suites.split(",")
    if unknown := set(chosen) - set(SUITES):
        p.error(f"unknown suites: {sorted(unknown)}")
    torch.set_num_threads(1)
    offline = offline_engine()
    results: dict = {}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="orcaserve-reliability-"))
    print(f"TorchServe's files and logs: {workdir}", file=sys.stderr)
    ts = start_server(workdir)
    suites = {
        "fuzz": lambda: live_fuzz(ts, offline, args.fuzz),
        "soak": lambda: soak(ts, offline, args.soak_clients, args.soak_minutes * 60),
        "kv_exhaustion": lambda: kv_exhaustion(ts, offline),
        "abandoned_stream": lambda: abandoned_stream(ts),
        "oversized_prompts": lambda: oversized_prompts(ts, offline),
        "sigkill": lambda: [kill_worker(ts, "SIGKILL"), kill_worker(ts, "SIGKILL")],
        "loop_death": lambda: kill_worker(ts, "loop"),
        "sigterm": lambda: sigterm_mid_stream(ts),
    }
    try:
        for name in SUITES:  # in this order: the worker-killing suites last
            if name in chosen:
                results[name] = suites[name]()
    finally:
        ts.stop()
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

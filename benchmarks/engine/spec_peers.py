"""llama.cpp's server speculating on the same GGUF file and prompts as `orcaserve-bench spec`
(`--peers llamacpp`): its n-gram lookup (`--spec-type ngram-simple`, no second model) against the
same server without speculation, each a fresh server with one slot per client, the same chat
prompts sent as closed-loop clients over its OpenAI route, greedy, the same `--max-tokens`. Its
tokens per second are counted from each answer's `usage`, as the engine's are from its outputs.
Recipe: docs/speculative-decoding.md "Benchmark"."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

# llama.cpp's settings for each arm: its simplest n-gram lookup at its defaults (the last n-gram
# of the history matched, the tokens after it drafted), and the same server with none.
ARMS = {"off": ["--spec-type", "none"], "ngram": ["--spec-type", "ngram-simple"]}


def closed_loop(
    url: str, prompts: list[str], clients: int, requests_n: int, max_tokens: int, headers: dict | None = None
) -> dict:
    """`requests_n` chat requests (cycling `prompts`), `clients` at a time, greedy: tokens/s from
    usage, and each answer's text by request index (to compare two runs)."""
    queue = list(range(requests_n))
    done: list[int] = []
    outputs: dict[int, str] = {}

    def client() -> None:
        with requests.Session() as s:
            s.headers.update(headers or {})
            while True:
                try:
                    i = queue.pop()
                except IndexError:  # another client took the last one
                    return
                body = {
                    "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "temperature": 0,
                    "max_tokens": max_tokens,
                }
                r = s.post(url, json=body, timeout=900)
                r.raise_for_status()
                answer = r.json()
                done.append(answer["usage"]["completion_tokens"])
                outputs[i] = answer["choices"][0]["message"]["content"]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - start
    return {"tokens": sum(done), "wall_s": wall, "tok_s": sum(done) / wall, "outputs": outputs}


def llamacpp_rows(gguf: str, sets: dict[str, list[str]], clients: list[int], args) -> tuple[list[dict], str]:
    """Per (set, clients): llama.cpp's tok/s off and with n-gram speculation (medians of
    `args.repeats` runs on one server each), or ([], why it was skipped)."""
    from orcaserve.bench.peers.llamacpp import BIN, llamacpp_env
    from orcaserve.bench.peers.parts import running
    from orcaserve.bench.serve.harness import free_ports

    if not gguf.endswith(".gguf"):
        return [], "llama.cpp serves a .gguf file: pass --model FILE.gguf"
    try:
        env = llamacpp_env()
    except SystemExit as e:
        return [], str(e)
    work = Path(tempfile.mkdtemp(prefix="orcaserve-spec-llamacpp-"))
    threads = len(os.sched_getaffinity(0))
    rates: dict[tuple[str, int, str], float] = {}
    for n in clients:
        for arm, flags in ARMS.items():
            [port] = free_ports(1)
            cmd = [str(BIN / "llama-server"), "-m", gguf, "-np", str(n), "-c", str(n * 2048), "-t", str(threads)]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-ui", *flags]
            with running(f"llamacpp-spec-{arm}-{n}", cmd, env, port, "/health", work, timeout=600):
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                for name, prompts in sets.items():
                    k = args.requests or max(4, n)
                    closed_loop(url, prompts, n, min(k, 2), args.max_tokens)  # warm-up, not counted
                    runs = [closed_loop(url, prompts, n, k, args.max_tokens)["tok_s"] for _ in range(args.repeats)]
                    rates[name, n, arm] = statistics.median(runs)
    rows = [
        {
            "set": name,
            "clients": n,
            "off_tok_s": round(rates[name, n, "off"], 2),
            "ngram_tok_s": round(rates[name, n, "ngram"], 2),
            "speedup": round(rates[name, n, "ngram"] / rates[name, n, "off"], 3),
        }
        for name in sets
        for n in clients
    ]
    return rows, ""


def peer_table(args: argparse.Namespace, sets: dict[str, list[str]], ours: list[dict], who: str = "orcaserve") -> dict:
    """llama.cpp's n-gram speculation on the same file and prompts, printed beside the rows of
    `who` (the engine offline, or served: spec_http.py)."""
    from orcaserve.scheduler.model.loader import default_model_path

    rows, why = llamacpp_rows(args.model or default_model_path(), sets, list(map(int, args.clients.split(","))), args)
    if not rows:
        print(f"llama.cpp skipped: {why}", file=sys.stderr)
        return {"llamacpp": None, "skipped": why}
    head = f"{'set':<6}{'clients':>8}{'llama.cpp off':>15}{'ngram':>9}{'speed-up':>10}"
    print(head + f"{who + ' ' + args.method + ' / its ngram':>33}", file=sys.stderr)
    for row in rows:
        mine = next((r for r in ours if (r["set"], r["clients"]) == (row["set"], row["clients"])), None)
        ratio = None if mine is None else mine[f"{args.method}_tok_s"] / row["ngram_tok_s"]
        row["orcaserve_over_llamacpp"] = None if ratio is None else round(ratio, 3)
        print(
            f"{row['set']:<6}{row['clients']:>8}{row['off_tok_s']:>15.1f}{row['ngram_tok_s']:>9.1f}"
            f"{row['speedup']:>9.2f}x{row['orcaserve_over_llamacpp'] or float('nan'):>32.2f}x",
            file=sys.stderr,
        )
    return {"llamacpp": rows}

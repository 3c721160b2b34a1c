"""The one client of every HTTP benchmark (serve, fair, slo-http, peers): one streamed OpenAI
completions request and its timings (`Result`, the one per-request record), and the two ways to
load a server with them: closed-loop clients (`clients`) and Poisson arrivals (`arrivals`)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from orcaserve.bench.serve.workload import Spec, poisson_offsets


@dataclass
class Result:
    index: int
    system: str
    rate: float | None
    input_len: int
    max_tokens: int
    sent: float = 0.0  # time.time() when the request was sent
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    status: int | None = None
    error: str | None = None
    batch: dict | None = field(default=None)  # the baseline's batch (start/end/size), if reported


def send(
    url: str,
    headers: dict,
    spec: Spec,
    system: str,
    rate: float | None,
    timeout: float,
    model_name: str | None = None,
    extra: dict | None = None,
) -> Result:
    """`extra`: more body fields (a server's own, such as vLLM's `priority`)."""
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model_name:
        body["model"] = model_name
    body.update(extra or {})
    res = Result(spec.index, system, rate, spec.input_len, spec.max_tokens)
    res.sent = time.time()
    t0 = time.perf_counter()
    usage = None
    done = False
    try:
        with requests.post(url, json=body, headers=headers, stream=True, timeout=timeout) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return res
            buf = b""
            for piece in r.iter_content(chunk_size=None):
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            res.error = f"in-band error: {obj['error']}"
                            continue
                        if obj.get("usage"):
                            usage = obj["usage"]
                        if obj.get("baseline_batch"):
                            res.batch = obj["baseline_batch"]
                        for choice in obj.get("choices") or []:
                            if choice.get("text"):
                                res.chunks += 1
                                if res.ttft is None:
                                    res.ttft = time.perf_counter() - t0
        res.e2e = time.perf_counter() - t0
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    res.output_tokens = int(usage["completion_tokens"]) if usage else res.chunks
    if res.ttft is None:  # no text at all (e.g. only whitespace-free special tokens)
        res.ttft = res.e2e
    if res.output_tokens > 1:
        res.tpot = (res.e2e - res.ttft) / (res.output_tokens - 1)
    return res


# ---- loads -----------------------------------------------------------------------------------
def clients(n: int, take: Callable[[int], Spec | None], one: Callable[[int, Spec], None], until: float = math.inf):
    """`n` closed-loop clients, started: client k sends `take(k)` (None: it stops) with `one(k, spec)`
    and takes the next when it is answered, until time.time() passes `until`. Join the threads."""

    def client(k: int) -> None:
        while time.time() < until and (spec := take(k)) is not None:
            one(k, spec)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def arrivals(specs: list[Spec], offsets: list[float], one: Callable[[Spec], None]) -> None:
    """`one(spec)` for each spec at its offset (s) from now, each in its own thread; returns when
    all are answered."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(specs), 512))) as pool:
        start = time.time()
        for spec, off in zip(specs, offsets):
            time.sleep(max(0.0, start + off - time.time()))
            pool.submit(one, spec)


def run_one(
    url: str,
    model: str,
    headers: dict,
    specs: list[Spec],
    rate: float | None,
    concurrency: int | None,
    seed: int,
    timeout: float,
    bar=None,
    model_name: str | None = None,
) -> list[Result]:
    """One system at one load: Poisson arrivals at `rate`, or `concurrency` closed-loop clients
    that share `specs` (each takes the next request when its last one ends) until all are sent."""
    results: list[Result] = []
    lock = threading.Lock()

    def one(spec: Spec, *_) -> None:
        res = send(url, headers, spec, model, rate, timeout, model_name)
        with lock:
            results.append(res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{model} errors={sum(r.error is not None for r in results)}")

    if concurrency:
        queue = list(reversed(specs))

        def take(_: int) -> Spec | None:
            with lock:
                return queue.pop() if queue else None

        for t in clients(concurrency, take, lambda _, spec: one(spec)):
            t.join()
    else:
        assert rate is not None
        arrivals(specs, poisson_offsets(len(specs), rate, seed), one)
    return sorted(results, key=lambda r: r.index)

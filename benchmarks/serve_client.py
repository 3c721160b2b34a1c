"""The load generator's client (benchmarks/serve_bench.py): one streamed OpenAI completions request with
its timings, and one rate's (or one closed loop's) worth of them."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from orcaserve.bench.serve_workload import Spec, poisson_offsets


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


# ---- one run (system x rate) -----------------------------------------------------------------
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

    def task(spec: Spec) -> None:
        res = send(url, headers, spec, model, rate, timeout, model_name)
        with lock:
            results.append(res)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(
                    f"{model} rate={rate if rate is not None else f'c{concurrency}'} "
                    f"errors={sum(r.error is not None for r in results)}"
                )

    if concurrency:
        queue = list(specs)

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    spec = queue.pop(0)
                task(spec)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        offsets = poisson_offsets(len(specs), rate, seed)
        with ThreadPoolExecutor(max_workers=min(len(specs), 512)) as pool:
            start = time.perf_counter()
            for spec, off in zip(specs, offsets):
                delay = start + off - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(task, spec)
    return sorted(results, key=lambda r: r.index)

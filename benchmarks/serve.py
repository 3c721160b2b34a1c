"""Load generator for a running TorchServe (orcaserve vs the request-level baseline), or for any
OpenAI completions endpoint (e.g. vLLM's server, benchmarks/peers/run.py).

    python benchmarks/serve.py --url http://127.0.0.1:8080 --key-file key_file.json \\
        --model smollm2 --model smollm2-baseline --rates 0.25,0.5,1,2 --duration 40 \\
        --out docs/benchmark-serving.json --plot docs/benchmark-serving.png
    python benchmarks/serve.py --endpoint http://127.0.0.1:8000/v1/completions --key none \\
        --model vllm --model-name smollm2 --concurrency 32 --num-requests 96 --out vllm.json

Every request is a streamed `POST /predictions/{model}/1.0/v1/completions` (or, with
`--endpoint`, a POST to that URL, one for all `--model`s or one per `--model`; `--model` is then
the system's label in the report and `--model-name` the body's `model` field) with token-id
prompts (exact input lengths), `max_tokens` = the sampled output length, `ignore_eos: true`,
greedy, and `stream_options.include_usage`. Arrivals are Poisson at each `--rates` value (the same
seeded workload, scaled in time, for every system and rate), or a closed loop of
`--concurrency` clients. Lengths come from `--input-len A:B` / `--output-len A:B` (uniform,
inclusive) or from `--dataset file.jsonl` (lines `{"prompt": str | [ids], "max_tokens": int?}`).

Per request: TTFT (send -> first non-empty text chunk), TPOT (mean time between tokens after the
first: (e2e - ttft) / (tokens - 1)), end-to-end latency, tokens. Per system and rate: request
throughput, output tokens/s, p50/p90/p99 of each latency, errors. Writes a JSON file, a PNG
(p50 / p99 latency vs achieved output tokens/s, one curve per system) and optionally a Markdown
results section into a doc between `<!-- serve-results:begin -->` / `<!-- serve-results:end -->`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import requests

from serve_report import BEGIN, END, command_line, machine, markdown, plot, summarize, update_doc, verdict
from serve_workload import Spec, _counts, _range, make_workload, poisson_offsets  # noqa: F401 (plot_schedule.py imports them from here)


# ---- one request -----------------------------------------------------------------------------
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


def send(url: str, headers: dict, spec: Spec, system: str, rate: float | None, timeout: float,
         model_name: str | None = None) -> Result:
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model_name:
        body["model"] = model_name
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
def run_one(url: str, model: str, headers: dict, specs: list[Spec], rate: float | None, concurrency: int | None,
            seed: int, timeout: float, bar=None, model_name: str | None = None) -> list[Result]:
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
                bar.set_postfix_str(f"{model} rate={rate if rate is not None else f'c{concurrency}'} "
                                    f"errors={sum(r.error is not None for r in results)}")

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


def read_key(args) -> str | None:
    if args.key:
        return None if args.key.lower() == "none" else args.key
    if os.environ.get("ORCASERVE_KEY"):
        return os.environ["ORCASERVE_KEY"]
    if args.key_file and os.path.exists(args.key_file):
        with open(args.key_file) as f:
            return json.load(f)["inference"]["key"]
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="TorchServe inference address")
    p.add_argument("--endpoint", action="append", default=[],
                   help="full OpenAI completions URL instead of TorchServe's path; once for all --model, "
                        "or once per --model")
    p.add_argument("--model", action="append", required=True,
                   help="model name (with --endpoint: the system's label); repeat to compare systems "
                        "(first = orcaserve, second = baseline)")
    p.add_argument("--model-name", default=None,
                   help="the body's `model` field (default: none for TorchServe, the --model value with --endpoint)")
    p.add_argument("--key", help="inference key, or `none` for no Authorization header "
                                 "(else $ORCASERVE_KEY, else --key-file)")
    p.add_argument("--key-file", default="key_file.json", help="TorchServe's key_file.json")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="one Poisson arrival rate (req/s)")
    load.add_argument("--rates", help="comma-separated Poisson rates (a sweep)")
    load.add_argument("--concurrency", type=int, help="closed loop: this many clients back to back, "
                                                       "--num-requests requests in all")
    p.add_argument("--num-requests", type=_counts, default=None,
                   help="requests per rate: N, or N1,N2,... one per rate (default: rate x --duration, "
                        "at least 8; concurrency: 32 in all)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--input-len", type=_range, default=(8, 128), help="prompt tokens A:B, uniform")
    p.add_argument("--output-len", type=_range, default=(1, 128), help="max_tokens A:B, uniform")
    p.add_argument("--token-range", type=_range, default=(1000, 40000), help="synthetic prompt token ids")
    p.add_argument("--dataset", help="JSONL prompts instead of synthetic ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests per system first")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout (s)")
    p.add_argument("--out", default="benchmark-serving.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--update-doc", default=None, help=f"write the results table between {BEGIN} / {END}")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    if args.rates:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    elif args.rate:
        rates = [args.rate]
    elif args.concurrency:
        rates = [None]
    else:
        p.error("give --rate, --rates or --concurrency")
    if any(r is not None and r <= 0 for r in rates):
        p.error("rates must be > 0")
    key = read_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.url.rstrip("/")
    if len(args.endpoint) not in (0, 1, len(args.model)):
        p.error(f"--endpoint: give one URL or one per --model ({len(args.model)})")

    def target(i: int, model: str) -> tuple[str, str | None]:
        """(URL, body `model` field) of the i-th system."""
        if args.endpoint:
            return args.endpoint[i if len(args.endpoint) > 1 else 0], args.model_name or model
        return f"{base}/predictions/{model}/1.0/v1/completions", args.model_name

    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"

    if args.num_requests and len(args.num_requests) not in (1, len(rates)):
        p.error(f"--num-requests: give one count or one per rate ({len(rates)})")

    def count(rate):
        if args.num_requests:
            return args.num_requests[rates.index(rate) if len(args.num_requests) > 1 else 0]
        return 32 if rate is None else max(8, round(rate * args.duration))

    n_max = max(count(r) for r in rates)
    specs = make_workload(n_max, args.seed, args.input_len, args.output_len, args.token_range, args.dataset)
    if args.dataset:
        desc = f"{args.dataset}, output max_tokens from the file or U{list(args.output_len)}"
    else:
        desc = (f"synthetic token-id prompts, input U[{args.input_len[0]}, {args.input_len[1]}] tokens, output "
                f"U[{args.output_len[0]}, {args.output_len[1]}] tokens (max_tokens, ignore_eos, greedy), seed {args.seed}")
    per_rate = f"{'/'.join(map(str, args.num_requests))} requests" if args.num_requests else f"{args.duration:g} s of arrivals"
    load_desc = (f"Poisson arrivals, {per_rate} per rate" if rates != [None]
                 else f"closed loop, {args.concurrency} clients, {count(None)} requests")
    desc += f"; {load_desc}"

    # Warm-up: first requests pay lazy initialisation; keep them out of the figures.
    for i, model in enumerate(args.model):
        url, name = target(i, model)
        for spec in make_workload(args.warmup, args.seed + 1, (8, 16), (2, 4), args.token_range):
            r = send(url, headers, spec, model, None, args.timeout, name)
            if r.error:
                print(f"warm-up request to {model} failed: {r.error}", file=sys.stderr)
                return 2

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(count(r) for r in rates) * len(args.model), unit="req", dynamic_ncols=True)
    all_results: list[Result] = []
    summaries = []
    try:
        for rate in rates:  # interleave systems per rate: drifting machine load hits both alike
            for i, model in enumerate(args.model):
                url, name = target(i, model)
                res = run_one(url, model, headers, specs[: count(rate)], rate, args.concurrency, args.seed,
                              args.timeout, bar, name)
                all_results += res
                summaries.append(summarize(res, rate, args.concurrency))
    finally:
        if bar is not None:
            bar.close()

    report = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "url": base,
        "endpoints": {model: target(i, model)[0] for i, model in enumerate(args.model)},
        "model_name": args.model_name,
        "systems": args.model,
        "workload": {"description": desc, "input_len": list(args.input_len), "output_len": list(args.output_len),
                     "dataset": args.dataset, "seed": args.seed, "rates": rates, "num_requests": [count(r) for r in rates], "concurrency": args.concurrency,
                     "duration_s": args.duration},
        "summaries": summaries,
        "verdict": verdict(summaries, args.model[0], args.model[1]) if len(args.model) >= 2 else None,
        "plot": plot_path,
        "requests": [asdict(r) for r in all_results],
    }
    report["command"] = os.environ.get("SERVE_BENCH_COMMAND", report["command"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, plot_path)
    text = markdown(report)
    if args.update_doc:
        update_doc(args.update_doc, text)
    print(text)
    errors = sum(s["errors"] for s in summaries)
    if errors:
        bad = [r for r in all_results if r.error][:5]
        for r in bad:
            print(f"error: {r.system} #{r.index}: {r.error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

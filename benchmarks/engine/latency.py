"""`orcaserve-bench latency`: a few users, each waiting on its answer (as `vllm bench latency`).

1, 2 and 4 concurrent streams (`--streams`), each a prompt of `--input-len` random token ids and
`--output-len` greedy tokens (EOS ignored), offline (the engine's own loop) and over HTTP
(TorchServe serving the archive with the same settings, streamed /v1/completions): output tokens
per second over all streams, and ms per output token (TPOT) and time to the first token per
stream, the best of `--repeats`. Beside each figure the DRAM roof: the measured read bandwidth over
the weight bytes a decode step reads (dram.py), in tokens per second per stream.

Peers on the same file where installed (benchmarks/peers/setup_llamacpp.sh, setup_vllm.sh):
llama.cpp's server with one slot per stream (`-np 1` for one stream), vLLM's OpenAI server
(`--peers llamacpp,vllm`); a peer not installed is named and skipped. Engine settings: the
engine's defaults unless `--set KEY=VALUE` (e.g. `--set quantization=none` for the dense path).
How to read it: docs/one-stream.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from orcaserve.bench.cli import engine_overrides
from orcaserve.bench.cpu import dram


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--streams", default="1,2,4", help="concurrent streams, comma-separated")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the best is kept")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured one-stream runs first, each system")
    ap.add_argument("--modes", default="offline,http", help="offline, http or both")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine argument override")
    ap.add_argument("--peers", default="", help="llamacpp,vllm over HTTP on the same model, where installed")
    ap.add_argument("--breakdown", action="store_true", help="offline: ms per decode step by part (step_breakdown.py)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="--breakdown: cpu is thread CPU time (use --threads 1)"
    )
    ap.add_argument(
        "--op-by-op", action="store_true", help="offline: the decoder's layers op by op, not one C++ call (A/B)"
    )
    ap.add_argument(
        "--thread-cpu", action="store_true", help="CPU ms per output token by process and thread (cpu_probe.py)"
    )
    ap.add_argument(
        "--ts-config", action="append", default=[], metavar="KEY=VALUE", help="HTTP: a config.properties entry"
    )
    ap.add_argument("--seed", type=int, default=0)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _summary(n: int, wall: float, ttft: list[float], tpot: list[float], output_len: int) -> dict:
    return {
        "streams": n,
        "tok_s": n * output_len / wall,
        "tpot_ms": 1e3 * statistics.mean(tpot),
        "stream_tok_s": 1 / statistics.mean(tpot),
        "ttft_ms": 1e3 * statistics.mean(ttft),
        "wall_s": wall,
    }


def offline_point(engine, output_len: int, prompts: list[list[int]]) -> dict:
    """One run of len(prompts) streams through the engine's loop: first and last token times."""
    from orcaserve.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    wall = time.perf_counter() - start
    ttft = [first[k] - start for k in first]
    tpot = [(last[k] - first[k]) / (output_len - 1) for k in first]
    return _summary(len(prompts), wall, ttft, tpot, output_len)


def http_point(url: str, key: str | None, prompts: list[list[int]], output_len: int, name: str | None) -> dict:
    """len(prompts) streamed completions sent at once (serve_client.send)."""
    from orcaserve.bench.serve.client import send
    from orcaserve.bench.serve.workload import Spec

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    specs = [Spec(i, p, len(p), output_len) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(lambda s: send(url, headers, s, "latency", None, 900, name), specs))
    wall = time.perf_counter() - start
    bad = [r.error for r in results if r.error or r.output_tokens != output_len]
    if bad:
        raise RuntimeError(f"latency: {len(bad)} of {len(results)} requests failed: {bad[0]}")
    return _summary(len(specs), wall, [r.ttft or 0.0 for r in results], [r.tpot or 0.0 for r in results], output_len)


def _points(run_one, streams: list[int], args, vocab: int, sid: int | None = None) -> list[dict]:
    """The best run (highest tok/s) of each stream count; `--warmup` unmeasured runs first. With
    `--thread-cpu` each run also holds the CPU its threads spent (those of this process, and of
    the server's session `sid`), per output token."""
    from orcaserve.bench.serve.cpu_probe import CpuProbe

    probe = CpuProbe(sid) if args.thread_cpu else None

    def measured(prompts: list[list[int]]) -> dict:
        before, t0 = (probe.snapshot() if probe else {}), time.perf_counter()
        row = run_one(prompts)
        if probe is not None:
            tokens = len(prompts) * args.output_len
            row["cpu"] = CpuProbe.delta(before, probe.snapshot(), tokens, time.perf_counter() - t0)
        return row

    for w in range(args.warmup):
        run_one(_prompts(1, args.input_len, vocab, args.seed + 999 + w))
    rows = []
    for n in streams:
        runs = [measured(_prompts(n, args.input_len, vocab, args.seed + r)) for r in range(args.repeats)]
        rows.append(max(runs, key=lambda r: r["tok_s"]))
    return rows


def _http_orcaserve(args, model: str, overrides: dict, streams: list[int], vocab: int) -> list[dict]:
    from orcaserve.bench.serve.local import orcaserve_archive, torchserve

    work = Path(tempfile.mkdtemp(prefix="orcaserve-latency-"))
    orcaserve_archive(work, "latency", overrides, model)
    extra = dict(kv.split("=", 1) for kv in args.ts_config)
    with torchserve(work, ["latency"], extra=extra) as ts:
        url = ts.url("/predictions/latency/1.0/v1/completions")
        key = ts.keys.get("inference")
        sid = ts.proc.pid if ts.proc else None
        return _points(lambda p: http_point(url, key, p, args.output_len, None), streams, args, vocab, sid)


def run(args: argparse.Namespace) -> dict:
    import torch

    from orcaserve.scheduler.engine import Engine
    from orcaserve.scheduler.model.loader import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)

    model = args.model or default_model_path()
    overrides = engine_overrides(args.set)
    streams = [int(s) for s in args.streams.split(",")]
    modes = args.modes.split(",")
    engine_args = {"max_num_seqs": max(streams), **overrides}
    engine = Engine.from_pretrained(model, **engine_args)
    if args.op_by_op and engine.runner.decoder is not None:
        engine.runner.decoder.layer_call = None
    vocab = engine.vocab_size
    gbps = dram.read_bandwidth()
    per_token = dram.bytes_per_token(engine.runner.model, engine.config.resolved_dtype(), engine.runner.decoder)
    roof = gbps * 1e9 / per_token
    res: dict = {
        "model": model,
        "engine_args": engine_args,
        "quantization": engine.config.quantization,
        "activations": engine.config.activations,
        "dtype": str(engine.config.resolved_dtype()).removeprefix("torch."),
        "read_gb_s": gbps,
        "bytes_per_token": per_token,
        "roof_tok_s": roof,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "systems": {},
    }
    if "offline" in modes:
        res["systems"]["orcaserve offline"] = _points(
            partial(offline_point, engine, args.output_len), streams, args, vocab
        )
    if args.breakdown:
        from orcaserve.bench.engine.step_breakdown import breakdown, weight_bytes

        prompts = {n: _prompts(n, args.input_len, vocab, args.seed) for n in streams}
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        res["breakdown"] = {str(n): breakdown(engine, prompts[n], args.output_len, clock) for n in streams}
        res["breakdown_clock"] = args.clock
        if engine.runner.decoder is not None:
            res["breakdown_bytes"] = weight_bytes(engine.runner.decoder, engine.config.resolved_dtype())
    del engine  # its memory back before the server loads its own
    if "http" in modes:
        res["systems"]["orcaserve http"] = _http_orcaserve(args, model, engine_args, streams, vocab)
    for name in [p for p in args.peers.split(",") if p]:
        from orcaserve.bench.engine.latency_peers import peer_rows

        rows, why = peer_rows(name, model, streams, args, vocab)
        if rows is None:
            res.setdefault("skipped", {})[name] = why
            print(f"latency: {name} skipped: {why}", file=sys.stderr)
        else:
            res["systems"][f"{name} http"] = rows
    report(res)
    return res


def _by_op(b: dict, nbytes: dict) -> str:
    """The lean decoder's ops in ms, each GEMM with the GB/s its weight was read at."""
    from orcaserve.bench.engine.step_breakdown import GEMMS, OPS

    def gemm(k: str) -> str:  # a rate only where every layer's GEMM ran on its own
        whole = k == "lm_head" or not b.get("layer")
        rate = f" ({nbytes[k] / b[k] / 1e6:.1f} GB/s)" if b[k] > 0 and k in nbytes and whole else ""
        return f"{k} {b[k]:.2f}{rate}"

    rest = (f"{k} {b[k]:.2f}" for k in (*OPS, "forward_rest", "inputs") if k in b)
    return ", ".join([*(gemm(k) for k in (*GEMMS, "lm_head")), *rest])


def report(res: dict) -> None:
    from orcaserve.bench.serve.cpu_probe import table as cpu_table

    print(
        f"\nmodel {res['model']}: quantization {res['quantization']}, activations {res['activations']}, "
        f"dtype {res['dtype']}; {res['bytes_per_token'] / 1e6:.1f} MB read per token, read bandwidth "
        f"{res['read_gb_s']:.1f} GB/s: DRAM roof {res['roof_tok_s']:.1f} tok/s per stream"
    )
    print(f"{'system':<22}{'streams':>8}{'tok/s':>9}{'ms/token':>10}{'per stream':>12}{'of roof':>9}{'TTFT ms':>9}")
    for system, rows in res["systems"].items():
        for r in rows:
            share = r["stream_tok_s"] / res["roof_tok_s"]
            print(
                f"{system:<22}{r['streams']:>8}{r['tok_s']:>9.1f}{r['tpot_ms']:>10.2f}"
                f"{r['stream_tok_s']:>12.1f}{share:>9.2f}{r['ttft_ms']:>9.0f}"
            )
    for system, rows in res["systems"].items():
        for r in rows:
            if "cpu" in r:
                print(f"\n{system}, {r['streams']} stream(s), the best run: {cpu_table(r['cpu'], top=10)}")
    for n, b in res.get("breakdown", {}).items():
        parts = ", ".join(f"{k} {b[k]:.2f}" for k in ("model", "lm_head", "sampler", "postprocess", "host"))
        clock = "thread CPU " if res.get("breakdown_clock") == "cpu" else ""
        print(f"decode step at {n} stream(s), {clock}ms: {b['step']:.2f} = {parts} (host: step - model - sampler)")
        if "forward_rest" in b:
            print(f"  of the model, by op: {_by_op(b, res.get('breakdown_bytes', {}))}")
    for name, why in res.get("skipped", {}).items():
        print(f"{name}: skipped ({why})")

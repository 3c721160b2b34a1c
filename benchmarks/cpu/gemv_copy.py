"""`orcaserve-bench kernels gemv-copy`: does the second bf16 weight copy for 1-4 row calls pay on AMX?

    orcaserve-bench kernels gemv-copy [--model PATH] [--streams 1,4] [--pairs 3] [--output-len 64] [--threads N]

On AMX the dispatch table's `linear` row runs bf16 with oneDNN's tiles and its `linear_gemv` row
the project's vdpbf16ps GEMM, so each bf16 `Linear` keeps a second copy of its weight for calls of
1-4 rows (`kernels/linear.py`). Two engines of the same dense bf16 model are built in one process:
`gemv` as the table says, `onednn` with the `linear_gemv` row set to the `linear` row's cells (one
packed copy at every row count; off AMX the two rows agree already and the engines are alike).
Then, per stream count, greedy decode of `--output-len` tokens (EOS ignored) alternates the two
`--pairs` times, the order swapped each pair: output tok/s by wall time and ms per step of
process CPU time (with `--threads 1` the figure a loaded machine does not inflate). Also printed:
the bytes of the second copies, and whether the two paths' greedy tokens agree. Decision and
figures: docs/one-stream.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from orcaserve.kernels import dispatch
from orcaserve.kernels.linear import Linear

ROW = ("linear_gemv", "bfloat16")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--streams", default="1,4", help="concurrent streams, comma-separated (1-4: GEMV-shaped)")
    ap.add_argument("--pairs", type=int, default=3, help="alternated runs of the two engines per stream count")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")


def second_copy_bytes() -> int:
    """Bytes of every live `Linear`'s GEMV copy."""
    return sum(o.gemv_weight.nbytes for o in gc.get_objects() if type(o) is Linear and o.gemv_weight is not None)


def _engine(model: str, single_copy: bool):
    from orcaserve.scheduler import Engine

    kept = dispatch.TABLE[ROW]
    if single_copy:  # the `linear` row's choice for 1-4 rows too
        dispatch.TABLE[ROW] = (dispatch.TABLE[("linear", "bfloat16")][0], kept[1])
    try:
        args = {"quantization": "none", "dtype": "bfloat16", "kv_cache_memory": 64 << 20, "max_num_seqs": 4}
        return Engine.from_pretrained(model, **args)
    finally:
        dispatch.TABLE[ROW] = kept


def run(args: argparse.Namespace) -> dict:
    from orcaserve.scheduler import SamplingParams, default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    engines = {"gemv": _engine(model, False)}
    copy_bytes = second_copy_bytes()
    engines["onednn"] = _engine(model, True)
    vocab = engines["gemv"].vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for e in engines.values():  # warm-up: first calls, oneDNN's per-shape compiles
        e.generate([[100, 200, 300]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    res: dict = {"model": model, "threads": torch.get_num_threads(), "second_copy_bytes": copy_bytes, "rows": []}
    for n in [int(s) for s in args.streams.split(",")]:
        prompts = [[(101 + 7 * i + 13 * j) % vocab for j in range(args.input_len)] for i in range(n)]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        tokens: dict[str, list] = {}
        for p in range(args.pairs):
            for name in list(engines) if p % 2 == 0 else list(engines)[::-1]:
                cpu, wall = time.process_time(), time.perf_counter()
                outs = engines[name].generate(prompts, params)
                runs[name].append((time.process_time() - cpu, time.perf_counter() - wall))
                tokens[name] = [o.output_token_ids for o in outs]
        for name, times in runs.items():
            res["rows"].append(
                {
                    "streams": n,
                    "path": name,
                    "tok_s": [n * args.output_len / w for _, w in times],
                    "cpu_ms_step": [1e3 * c / args.output_len for c, _ in times],
                }
            )
        res["rows"][-1]["same_tokens"] = tokens["gemv"] == tokens["onednn"]
    report(res)
    return res


def report(res: dict) -> None:
    mb = res["second_copy_bytes"] / 1e6
    print(f"\n{res['model']}, dense bf16, {res['threads']} thread(s): second copies {mb:.1f} MB")
    print(f"{'streams':>8} {'path':<8}{'tok/s median':>14}{'(runs)':>24}{'CPU ms/step median':>20}{'min':>8}")
    for r in res["rows"]:
        runs = " ".join(f"{t:.1f}" for t in r["tok_s"])
        cpu = r["cpu_ms_step"]
        print(
            f"{r['streams']:>8} {r['path']:<8}{statistics.median(r['tok_s']):>14.1f}{runs:>24}"
            f"{statistics.median(cpu):>20.2f}{min(cpu):>8.2f}"
        )
        if "same_tokens" in r:
            print(f"{'':>8} greedy tokens of the two paths equal: {r['same_tokens']}")

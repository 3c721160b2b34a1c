"""`orcaserve-bench bitnet`: BitNet b1.58 at the 2B4T shape, ternary against its bf16 twin, in one run.

The same random weights (benchmarks/models/bitnet_2b4t.py) as formats of one model, each loaded
by its own engine, all held at once, and measured offline at each stream count alternated point
by point, format after format, for `--repeats` rounds (`orcaserve-bench latency`'s points:
`--output-len` greedy tokens a stream, EOS ignored; the best of the rounds is kept):

- `bf16`: the bf16 checkpoint, every projection expanded to bf16 (served dense, as any lean model);
- `tq2_0`, `tq1_0`: llama.cpp's GGUF files of the packed checkpoint (ternary projections over
  int8 activations, docs/bitnet.md), the head tied to the F16 embedding;
- `tq2_0-q6_k`, `tq2_0-q8_0`: the `tq2_0` file through llama.cpp's `llama-quantize`, its tied head
  in Q6_K (its default) or Q8_0, served from those blocks (docs/bitnet.md, "A quantized lm_head");
  their twins `bf16-q6_k`, `bf16-q8_0`: the bf16 checkpoint with that head dequantized. A format's
  ratio is taken against its own twin where it was run (`tq2_0-q6_k` against `bf16-q6_k`), else
  against `bf16`.

`--layers 4` (the default) is the 2B4T's first 4 layers under its full 128256-token head, where the
head is most of a token's bytes; `--layers 0` the full 30 layers (the bf16 twin then takes about
10 GB). Beside each format: its load time, the weight bytes a decode step reads, and its tok/s over
the bf16 twin's at the same stream count. `--peers llamacpp` adds llama.cpp's server over HTTP on
each GGUF file (`latency`'s peer, one slot per stream), to find its fastest ternary format here.
"""

from __future__ import annotations

import argparse
import time

from orcaserve.bench.cli import engine_overrides
from orcaserve.bench.cpu import dram

FORMATS = ("bf16", "tq2_0", "tq1_0")  # the default run; bf16 is the twin its ratios are taken against
HEADS = ("q6_k", "q8_0")  # `<format>-<head>`: llama-quantize's head types


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=4, help="the 2B4T's first N layers; 0: all 30")
    ap.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="bf16, tq2_0, tq1_0, and with a head type tq2_0-q6_k, bf16-q6_k, ... comma-separated",
    )
    ap.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated")
    ap.add_argument("--input-len", type=int, default=16, help="prompt tokens per stream")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per stream")
    ap.add_argument("--repeats", type=int, default=2, help="rounds, formats alternated; the best is kept")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured one-stream runs first, each format")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine argument override")
    ap.add_argument("--peers", default="", help="llamacpp: its server over HTTP on each GGUF format")
    ap.add_argument("--seed", type=int, default=0)


def model_path(fmt: str, layers: int | None) -> str:
    """The cached file or directory of `fmt` (built on first use)."""
    from orcaserve.bench.models.bitnet_2b4t import bitnet_2b4t, bitnet_2b4t_gguf, bitnet_2b4t_twin

    base, _, head = fmt.partition("-")
    if base not in FORMATS or (head and (head not in HEADS or base == "tq1_0")):
        raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)}, or tq2_0 / bf16 - {'/'.join(HEADS)}")
    if base == "bf16":
        return bitnet_2b4t_twin(head.upper(), layers) if head else bitnet_2b4t("bf16", layers=layers)
    return bitnet_2b4t_gguf(base.upper(), layers=layers, head=head.upper() or None)


def twin_of(fmt: str, formats: dict) -> str:
    """The format `fmt`'s ratio is taken against: its own head's bf16 twin where it was run, else bf16."""
    _, _, head = fmt.partition("-")
    return f"bf16-{head}" if head and f"bf16-{head}" in formats else "bf16"


def _load(path: str, streams: list[int], overrides: dict) -> tuple[object, dict]:
    """One format's engine, its load time and the weight bytes a decode step reads."""
    from orcaserve.scheduler.engine import Engine

    start = time.perf_counter()
    engine = Engine.from_pretrained(path, max_num_seqs=max(streams), **overrides)
    load_s = time.perf_counter() - start
    per_token = dram.bytes_per_token(engine.runner.model, engine.config.resolved_dtype(), engine.runner.decoder)
    return engine, {"path": path, "load_s": load_s, "bytes_per_token": per_token, "vocab": engine.vocab_size}


def _alternated(engines: dict, streams: list[int], args) -> dict[str, list[dict]]:
    """Each format's best run per stream count, the formats alternated point by point for
    `--repeats` rounds (on a shared machine the load drifts: each format sees the same drift)."""
    from orcaserve.bench.engine.latency import _prompts, offline_point

    for engine in engines.values():
        for w in range(args.warmup):
            offline_point(engine, args.output_len, _prompts(1, args.input_len, engine.vocab_size, args.seed + 999 + w))
    best: dict[str, dict[int, dict]] = {fmt: {} for fmt in engines}
    for r in range(args.repeats):
        for n in streams:
            for fmt, engine in engines.items():
                row = offline_point(
                    engine, args.output_len, _prompts(n, args.input_len, engine.vocab_size, args.seed + r)
                )
                print(f"bitnet: round {r}, {fmt}, {n} stream(s): {row['tok_s']:.1f} tok/s", flush=True)
                if n not in best[fmt] or row["tok_s"] > best[fmt][n]["tok_s"]:
                    best[fmt][n] = row
    return {fmt: [rows[n] for n in streams] for fmt, rows in best.items()}


def run(args: argparse.Namespace) -> dict:

    layers = args.layers or None
    streams = [int(s) for s in args.streams.split(",")]
    overrides = engine_overrides(args.set)
    res: dict = {"layers": layers or 30, "read_gb_s": dram.read_bandwidth(), "formats": {}, "peers": {}}
    engines = {}
    for fmt in args.formats.split(","):
        engines[fmt], res["formats"][fmt] = _load(model_path(fmt, layers), streams, overrides)
    for fmt, rows in _alternated(engines, streams, args).items():
        res["formats"][fmt]["rows"] = rows
    del engines  # their memory back before a peer's server loads
    args.thread_cpu = False  # latency's _points reads it
    for peer in [p for p in args.peers.split(",") if p]:
        from orcaserve.bench.engine.latency_peers import peer_rows

        for fmt, got in res["formats"].items():
            if got["path"].endswith(".gguf"):
                rows, why = peer_rows(peer, got["path"], streams, args, got["vocab"])
                print(f"bitnet: {peer} on {fmt}: {[round(r['tok_s'], 1) for r in rows or []]} tok/s {why}", flush=True)
                res["peers"][f"{peer} {fmt}"] = rows if rows is not None else why
    report(res)
    return res


def report(res: dict) -> None:
    gbps = res["read_gb_s"]
    print(f"\nBitNet 2B4T shape, {res['layers']} layers; read bandwidth {gbps:.1f} GB/s")
    head = [("streams", 8), ("tok/s", 9), ("ms/token", 10), ("MB/token", 10), ("of roof", 9), ("x bf16", 8)]
    head.append(("load s", 8))
    print(f"{'format':<18}" + "".join(f"{name:>{width}}" for name, width in head))
    for fmt, got in res["formats"].items():
        twin = {r["streams"]: r["tok_s"] for r in res["formats"].get(twin_of(fmt, res["formats"]), {}).get("rows", [])}
        roof = gbps * 1e9 / got["bytes_per_token"]
        for r in got["rows"]:
            ratio = f"{r['tok_s'] / twin[r['streams']]:.2f}" if r["streams"] in twin else "-"
            print(
                f"{'orcaserve ' + fmt:<18}{r['streams']:>8}{r['tok_s']:>9.1f}{r['tpot_ms']:>10.2f}"
                f"{got['bytes_per_token'] / 1e6:>10.1f}{r['stream_tok_s'] / roof:>9.2f}{ratio:>8}{got['load_s']:>8.1f}"
            )
    for name, rows in res["peers"].items():
        if isinstance(rows, str):
            print(f"{name}: skipped ({rows})")
            continue
        for r in rows:
            print(f"{name + ' http':<18}{r['streams']:>8}{r['tok_s']:>9.1f}{r['tpot_ms']:>10.2f}")

"""CUDA graphs on vs off: decode steps up to batch 256 (median, p90, replayed share, kernel time
over wall at the largest batch, bytes bound), end to end with step times by kind, fp32 exactness
on vs off (docs/kernels.md "GPU check", steps engine_graphs and engine_8b).

    orcaserve-bench gpu graphs --out graphs.json        # CUDA: SmolLM2-135M's shape, bf16
    orcaserve-bench gpu graphs --shape llama8b --sides on --no-exact --batches 1,64,256
    orcaserve-bench gpu graphs --smoke --out g.json     # CPU plumbing: tiny model, no graphs

The two engines (same KV cache size, 16 GiB) are built one after the other. --smoke on the CPU:
no graph can be captured there, so "on" runs every step padded to its graph's sizes, eagerly
(`ModelRunner.pad_steps`), which exercises the same inputs a graph would read.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections import deque

from orcaserve.bench.gpu.common import (
    SHAPES,
    SMOKE_SHAPE,
    ByteTokenizer,
    Results,
    copy_gbps,
    device,
    free_cuda,
    shaped_model,
)

KV_BYTES = 16 << 30


def decode_bound(model, batch: int, context: int, gbps: float | None) -> dict:
    """Bytes one decode step of `batch` requests at `context` tokens reads (the weights, tied ones
    once, and the K/V), and the time they take at `gbps` (None without a measurement)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem
    out = {"weight_bytes": weights, "kv_bytes": kv, "copy_gbps": gbps}
    if gbps:
        out["bound_ms"] = (weights + kv) / (gbps * 1e9) * 1e3
    return out


def build(model, on: bool, args, dev, **engine_args):
    import torch

    from orcaserve.scheduler import Engine

    t = time.perf_counter()
    engine = Engine.from_model(
        copy.deepcopy(model),
        ByteTokenizer(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=KV_BYTES if dev.type == "cuda" else 1 << 28,
        cuda_graphs=on,
        enable_prefix_caching=False,  # random prompts share nothing
        **engine_args,
    )
    if dev.type != "cuda":
        engine.runner.pad_steps = on  # the padded inputs a graph would read, run eagerly
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    graphs = engine.runner.graphs
    info = {
        "startup_s": time.perf_counter() - t,
        "graphs_captured": len(graphs.graphs) if graphs else 0,
        "capture_s": graphs.capture_seconds if graphs else 0.0,
        "use_graphs": engine.runner.use_graphs,
        "padded_eager": engine.runner.pad_steps,  # the CPU smoke's stand-in for graphs
    }
    return engine, info


def replays(engine) -> int:
    return engine.runner.graphs.replays if engine.runner.graphs else 0


def kernel_fraction(step, n: int) -> dict:
    """Kernel time torch.profiler records over `n` calls of `step`, over their wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(n):
                step()
            wall = time.perf_counter() - t
        cuda = torch.autograd.DeviceType.CUDA
        us = sum(
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            for e in prof.key_averages()
            if e.device_type == cuda
        )
        return {"kernel_time_fraction": us * 1e-6 / wall, "wall_s": wall, "steps": n}
    except Exception as e:  # a profiler API of another version: report, go on
        return {"error": f"{type(e).__name__}: {e}"}


def decode_steps(engine, batch: int, args, profile_steps: int, bound=None) -> dict:
    from orcaserve.scheduler import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=args.steps + profile_steps + 8, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    vocab = engine.vocab_size
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill, not timed
    for _ in range(3):
        engine.step()
    before, times = replays(engine), []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    row = {
        "batch": batch,
        "context": args.context,
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * (len(times) - 1))],
        "replayed_fraction": (replays(engine) - before) / args.steps,
    }
    if bound is not None:  # K/V read: the context plus about half the timed steps' new tokens
        row["bytes"] = bound(batch, args.context + 3 + args.steps // 2)
        if row["bytes"].get("bound_ms"):
            row["over_bytes_bound"] = row["median_ms"] / row["bytes"]["bound_ms"]
    if profile_steps:
        row["profile"] = kernel_fraction(engine.step, profile_steps)
    for rid in ids:
        engine.abort(rid)
    return row


def end_to_end(engine, work) -> dict:
    from orcaserve.scheduler import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    engine.trace = deque(maxlen=100_000)  # every step's start and end, and what it ran
    before, steps0 = replays(engine), engine.stats.num_steps
    t, t0 = time.perf_counter(), time.time()
    outs = engine.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t
    assert [o.completion_tokens for o in outs] == [n for _, n in work]
    kinds: dict[str, list[float]] = {"decode_only": [], "with_prompt": []}
    for s in engine.trace:
        decode = all(prefill == 0 for prefill, _ in s.requests.values())
        kinds["decode_only" if decode else "with_prompt"].append((s.end - s.start) * 1e3)
    steps = engine.stats.num_steps - steps0
    return {
        "useful_tok_s": sum(n for _, n in work) / wall,
        "wall_s": wall,
        "window": [t0, t0 + wall],  # epoch seconds: gpu_check.sh reads SM busy (dmon) over it
        "steps": steps,
        "replayed_fraction": (replays(engine) - before) / max(1, steps),
        "step_ms_by_kind": {
            k: {"steps": len(v), "median_ms": statistics.median(v) if v else None, "total_s": sum(v) / 1e3}
            for k, v in kinds.items()
        },
    }


def exact(dev, args) -> dict:
    import torch

    from orcaserve.bench.gpu.exact import tiny_model
    from orcaserve.scheduler import SamplingParams

    model = tiny_model("llama", args.smoke).to(device=dev, dtype=torch.float32)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (1, 2, 15, 16, 17, 33, 100, 255)]
    prompts += [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 600))] for _ in range(8)]
    if args.smoke:
        prompts = prompts[:4]
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 24, ignore_eos=True) for i in range(len(prompts))]
    got = {}
    for on in (True, False):
        a = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=512)
        engine, _ = build(model, on, a, dev, dtype="float32")
        got[on] = [o.output_token_ids for o in engine.generate(prompts, params)]
        del engine
        free_cuda()
    same = sum(x == y for x, y in zip(got[True], got[False]))
    return {"requests": len(prompts), "identical_sequences": same, "pass": same == len(prompts)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "llama8b"))
    ap.add_argument("--sides", default="on,off", help="graphs on and/or off")
    ap.add_argument("--no-exact", action="store_true", help="skip the fp32 on-vs-off exactness check")
    from orcaserve.bench.serve.workload import add_offline_args

    add_offline_args(ap)
    ap.set_defaults(num_prompts=256, max_num_seqs=256, max_num_batched_tokens=4096)


def run(args: argparse.Namespace) -> dict:
    import torch

    from orcaserve.bench.serve.workload import offline_workload_of, workload_sha256

    dev = device("graphs", args.smoke)
    if isinstance(dev, dict):
        return dev
    cuda = dev.type == "cuda"
    if args.smoke:
        args.batches, args.context, args.steps, args.num_prompts = "1,3", 24, 4, 6
        args.max_num_seqs, args.max_num_batched_tokens, args.min_prompt, args.max_prompt = 4, 64, 4, 24
        args.min_out, args.max_out = 2, 5
    dtype = torch.bfloat16 if cuda else torch.float32
    model = shaped_model(dev, dtype, args.smoke, args.shape)
    gbps = copy_gbps(dev)
    work = offline_workload_of(args, model.config.vocab_size)
    keys = ("num_prompts", "seed", "min_prompt", "max_prompt", "min_out", "max_out")
    res = Results(
        args.out, dev, step="graphs", model="smoke shape" if args.smoke else f"random-init, {args.shape} shape",
        model_config=SMOKE_SHAPE if args.smoke else SHAPES[args.shape], workload_sha256=workload_sha256(work),
        dtype=str(dtype).removeprefix("torch."), max_out=args.max_out,
        engine={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        workload={k: getattr(args, k) for k in keys}, on={}, off={},
    )  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    for on in [name == "on" for name in args.sides.split(",")]:
        side = res.data["on" if on else "off"]
        print(f"graphs {'on' if on else 'off'}: building ...", flush=True)
        engine, info = build(model, on, args, dev, dtype=str(dtype).removeprefix("torch."))
        side.update(info, decode=[])
        res.save()
        for b in batches:
            bound = lambda batch, ctx: decode_bound(model, batch, ctx, gbps)  # noqa: E731
            side["decode"].append(decode_steps(engine, b, args, 10 if b == batches[-1] and cuda else 0, bound))
            print(f"  decode B={b}: {side['decode'][-1]['median_ms']:.2f} ms", flush=True)
            res.save()
        side["end_to_end"] = end_to_end(engine, work)
        print(f"  end to end: {side['end_to_end']['useful_tok_s']:.0f} useful tok/s", flush=True)
        side["lazy_graphs"] = len(engine.runner.graphs.graphs) - info["graphs_captured"] if engine.runner.graphs else 0
        res.save()
        del engine
        free_cuda()
    if res.data["on"] and res.data["off"]:
        on_e2e, off_e2e = res.data["on"]["end_to_end"], res.data["off"]["end_to_end"]
        res.data["speedup_end_to_end"] = on_e2e["useful_tok_s"] / off_e2e["useful_tok_s"]
        res.data["speedup_decode"] = {
            str(a["batch"]): b["median_ms"] / a["median_ms"]
            for a, b in zip(res.data["on"]["decode"], res.data["off"]["decode"])
        }
    res.data["exact_fp32"] = {"pass": True, "skipped": "--no-exact"} if args.no_exact else exact(dev, args)
    res.save()
    print(
        f"end to end {res.data.get('speedup_end_to_end')}x, decode {res.data.get('speedup_decode')}, "
        f"exact {res.data['exact_fp32']}",
        flush=True,
    )
    return {**res.data, "exit_code": 0 if res.data["exact_fp32"]["pass"] else 1}

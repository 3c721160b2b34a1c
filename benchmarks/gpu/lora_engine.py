"""LoRA adapters on the GPU engine: the Triton path (shrink/expand through the dispatch table, the
stacks and step descriptors on the device, CUDA graphs on for the steps without adapters) against
the same engine with the PyTorch twins and graphs off; greedy tokens of every request equal, and
tok/s of each (docs/kernels.md "GPU check", docs/lora.md "The Triton kernels in the engine").

    orcaserve-bench gpu lora_engine [--dtype fp32] [--adapters 4] [--rank 16] [--requests 12]
                                    [--max-tokens 32] [--out lora-engine.json]
    orcaserve-bench gpu lora_engine --smoke     # CPU, TRITON_INTERPRET=1, fp32, tiny: every code path

The engine refuses adapters off the CPU; this step alone lifts that with ORCASERVE_LORA_GPU_CHECK=1
(set here, for this process), to prove on the device what the interpreter proved on the CPU
(tests/engine/test_lora_triton.py). Both sides run the Triton attention and the same base GEMMs:
only the LoRA update's kernels, the graphs and the overlapped scheduling (the Triton side's, as
the engine's default on CUDA) differ. fp32 by default: the Triton kernels are the
twin's within fp32 accumulation (greedy tokens equal); in fp16/bf16 an intermediate may round to
its neighbour, so a differing token there is reported, not failed (`tokens_equal_required` false).
Requests go a third each to the base model and spread over the adapters, arriving together: steps
mix adapters and base rows. Exit status 1 if an fp32 output differs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from orcaserve.bench.gpu.common import ByteTokenizer, Results, device, device_name, free_cuda, shaped_model, torch_dtype

SIDES = ("twin_eager", "triton_graphs")  # the oracle first


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp32")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 (fp32), tiny")


def run_side(side: str, model, dev, dtype, adapters: dict[str, str], work: list) -> dict:
    import copy

    from orcaserve.kernels.pytorch.lora import lora_batched_parts, lora_sgmv
    from orcaserve.scheduler import Engine, SamplingParams

    engine = Engine.from_model(
        copy.deepcopy(model), ByteTokenizer(), attention_backend="triton", dtype=dtype, lora_adapters=adapters,
        cuda_graphs=side == "triton_graphs" and dev.type == "cuda", max_num_seqs=16, max_num_batched_tokens=256,
        block_size=16, async_scheduling=side == "triton_graphs",
    )  # fmt: skip
    loras = engine.runner.loras
    if side == "twin_eager":  # the oracle: the PyTorch twins on the same device
        loras.op = lora_sgmv
        loras.use_batched(lora_batched_parts, False)
    stacks = {str(t.device) for ab in loras._stacks.values() for t in ab}
    t = time.perf_counter()
    for rid, prompt, n, lora in work:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora=lora)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    secs = time.perf_counter() - t
    row: dict = {"outputs": [outs[w[0]] for w in work], "seconds": round(secs, 2), "stacks_on": sorted(stacks)}
    row["tok_s"] = round(sum(map(len, outs.values())) / secs, 1)
    g = engine.runner.graphs
    row["graph_replays"] = g.replays if g is not None and engine.runner.use_graphs else 0
    cells = getattr(loras.batched_op, "__self__", None)
    row["descriptor_uploads"] = getattr(getattr(cells, "buffers", None), "uploads", None)
    del engine
    free_cuda()
    return row


def run(args: argparse.Namespace) -> dict:
    dev = device("lora_engine", args.smoke)
    if isinstance(dev, dict):
        return dev
    from orcaserve.bench.engine.lora import write_adapter
    from orcaserve.scheduler.lora.config import GPU_CHECK_ENV

    os.environ[GPU_CHECK_ENV] = "1"  # this step's opt-in (module docstring)
    if dev.type != "cuda":
        args.adapters, args.requests, args.max_tokens = min(args.adapters, 2), min(args.requests, 6), 4
        args.rank = min(args.rank, 8)
    dtype = torch_dtype(args.dtype, dev)
    model = shaped_model(dev, dtype, smoke=dev.type != "cuda")
    tmp = Path(tempfile.mkdtemp(prefix="lora_engine."))
    adapters = {}
    for i in range(args.adapters):
        write_adapter(tmp / f"a{i}", model.config, args.rank, seed=16000 + i, std=0.05)
        adapters[f"a{i}"] = str(tmp / f"a{i}")
    import random

    rng = random.Random(0)
    names: list[str | None] = [None, *adapters]
    vocab = model.config.vocab_size
    work = [
        (f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 40]))], args.max_tokens,
         names[i % len(names)] if i % 3 else None)
        for i in range(args.requests)
    ]  # fmt: skip
    res = Results(getattr(args, "out", None), dev, dtype=str(dtype), adapters=args.adapters, rank=args.rank)
    sides: dict = {}
    res.data["sides"] = sides
    for side in SIDES:
        sides[side] = run_side(side, model, dev, dtype, adapters, work)
        res.save()
    import torch

    oracle = sides[SIDES[0]]["outputs"]
    res.data["all_equal"] = all(s["outputs"] == oracle for s in sides.values())
    res.data["tokens_equal_required"] = dtype == torch.float32
    res.data["elapsed_s"] = round(time.perf_counter() - res.t0, 1)
    for s in sides.values():
        s["outputs"] = [o[:16] for o in s["outputs"]]  # heads only in the JSON
    res.save()
    for name, s in sides.items():
        print(f"{name:<14} {s['tok_s']:9.1f} tok/s  replays {s['graph_replays']}  stacks on {s['stacks_on']}")
    print(f"all_equal {res.data['all_equal']} ({dtype}) on {device_name(dev)}")
    ok = res.data["all_equal"] or not res.data["tokens_equal_required"]
    return {**res.data, "exit_code": 0 if ok else 1}

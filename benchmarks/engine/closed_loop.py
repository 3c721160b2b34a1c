"""The HTTP load's requests without HTTP: the engine in this process, fed by closed-loop clients.

    orcaserve-bench closed-loop                        # the peers' HTTP load (96 requests, 32 clients), bf16
    orcaserve-bench closed-loop --via loop             # through the serving thread (EngineLoop) and asyncio readers
    orcaserve-bench closed-loop --via engine,loop --repeats 2   # both, alternated

The requests are `orcaserve-bench serve`'s (the same seed, lengths and token ids as
`orcaserve-bench peers --workloads http`), after the same warm-up load, with the peers' engine
limits. `--via engine`: one thread steps the engine and gives a client's next request to it as
soon as its previous one finished (no round trip at all): the engine's own throughput on this
arrival pattern. `--via loop`: the serving thread of the worker (`EngineLoop`, its admission
thread) and one asyncio thread reading every stream as the handler does (`RequestStream.follow`),
each client submitting its next request from that thread when its last output came: what the
worker does without TorchServe's frontend, sockets and frames. The gap between the two, and
between `loop` and `serve` over HTTP, says where the serving path's cost sits
(docs/serving.md, "The engine's CPU over HTTP").

Per run: output tok/s, steps and rows (decode rows, prompt tokens) per output token, the model
runs' time by kind, and the CPU of this process's threads by name (the engine's thread and the
OpenMP workers it started share its name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import torch

from orcaserve.bench.cli import command
from orcaserve.bench.engine.offline import _time_model_runs
from orcaserve.bench.peers.parts import ENGINE_LIMITS
from orcaserve.bench.serve import run_delay
from orcaserve.bench.serve.cpu_probe import CpuProbe
from orcaserve.bench.serve.workload import Spec, make_workload
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.loader import load_model_and_tokenizer
from orcaserve.scheduler.sampling_params import RequestOutputKind
from orcaserve.scheduler.serving.engine_loop import EngineLoop
from orcaserve.scheduler.serving.os_thread import name_spawned_threads, name_this_thread

VIAS = ("engine", "loop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", help="fp32 | bf16")
    p.add_argument("--via", default="engine,loop", help="engine, loop or both (alternated per repeat)")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--warmup-load", type=int, default=96, help="unrecorded requests first (another seed)")
    p.add_argument("--input-len", default="16:256")
    p.add_argument("--output-len", default="8:128")
    p.add_argument("--token-range", default="100:49152", help="ids A:B, as `peers` sends them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs of each via, each in a process of its own")


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b or a)


def _params(spec: Spec) -> SamplingParams:
    # What the OpenAI handler asks for a streamed request: an output after every step (DELTA).
    return SamplingParams(
        temperature=0, max_tokens=spec.max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


def run_engine(engine: Engine, specs: list[Spec], clients: int) -> int:
    """Each finished request hands its client's next one to the engine before the next step."""
    queue = deque(specs)
    for _ in range(min(clients, len(queue))):
        s = queue.popleft()
        engine.add_request(f"c{s.index}", s.prompt, _params(s))
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished and queue:
                s = queue.popleft()
                engine.add_request(f"c{s.index}", s.prompt, _params(s))
    return tokens


def run_loop(loop: EngineLoop, specs: list[Spec], clients: int, tag: str, cpu: list[float]) -> int:
    """Clients on one asyncio thread read their streams as the handler does; each submits its
    next request when its last output came. The thread's CPU seconds are appended to `cpu` (it
    ends before the probe's snapshot, which sees only live threads)."""
    queue = deque(specs)

    async def client(event_loop: asyncio.AbstractEventLoop) -> int:
        tokens = 0

        def count(outputs: list) -> None:
            nonlocal tokens
            tokens += sum(len(o.new_token_ids) for o in outputs)

        while queue:
            s = queue.popleft()
            request = EngineRequest(f"{tag}{s.index}", s.prompt, _params(s))
            await loop.submit(request, event_loop=event_loop).follow(count)
        return tokens

    async def main() -> int:
        event_loop = asyncio.get_running_loop()
        tokens = sum(await asyncio.gather(*(client(event_loop) for _ in range(clients))))
        cpu.append(time.thread_time())
        return tokens

    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(asyncio.run(main())), name="asyncio-readers")
    reader.start()
    reader.join()
    return got[0]


def measure(via: str, engine: Engine, loop: EngineLoop | None, args, warm: list[Spec], specs: list[Spec]) -> dict:
    def once(work: list[Spec], tag: str) -> int:
        if via == "engine":
            return run_engine(engine, work, args.concurrency)
        assert loop is not None
        return run_loop(loop, work, args.concurrency, tag, reader_cpu)

    reader_cpu: list[float] = []
    once(warm, "w")
    if via == "engine":  # this thread steps the engine: named as the serving thread and its workers are
        name_spawned_threads("orca-omp")
        name_this_thread("orca-engine")
    reader_cpu.clear()
    by_kind = _time_model_runs(engine)
    steps0, probe = engine.stats.num_steps, CpuProbe(None)
    before, t = probe.snapshot(), time.perf_counter()
    tokens = once(specs, "m")
    wall = time.perf_counter() - t
    cpu = CpuProbe.delta(before, probe.snapshot(), tokens, wall)
    cpu["threads"] = [r for r in cpu["threads"] if r["thread"] != "(ended threads)"]  # the reader, named below
    for spent in reader_cpu:  # the asyncio thread's row (`loop`)
        row = {"role": "client", "process": "closed-loop", "thread": "asyncio-readers", "cpu_s": round(spent, 3)}
        row.update(ms_per_token=round(1e3 * spent / tokens, 4), cores=round(spent / wall, 3))
        cpu["threads"].append(row)
    del engine.runner.execute  # the class's own again (_time_model_runs set it on the instance)
    steps = engine.stats.num_steps - steps0
    assert tokens == sum(s.max_tokens for s in specs), (tokens, sum(s.max_tokens for s in specs))
    rows = sum(k["tokens"] for k in by_kind.values())
    prompt_tokens = sum(s.input_len for s in specs)
    return {
        "via": via,
        "output_tok_s": tokens / wall,
        "wall_s": wall,
        "output_tokens": tokens,
        "steps": steps,
        "steps_per_token": steps / tokens,
        "tokens_per_step": rows / max(steps, 1),
        "decode_rows_per_step": (rows - prompt_tokens) / max(steps, 1),
        "model_runs": by_kind,
        "model_s": sum(k["model_s"] for k in by_kind.values()),
        "cpu": cpu,
    }


def _print(r: dict) -> None:
    threads = ", ".join(
        f"{t['thread']} {t['ms_per_token']:.2f} ms ({t['cores']:.2f} cores)" for t in r["cpu"]["threads"][:3]
    )
    print(
        f"{r['via']:>7}: {r['output_tok_s']:6.1f} tok/s, {r['steps']} steps, {r['steps_per_token']:.4f} steps/token,"
        f" {r['tokens_per_step']:.1f} tokens and {r['decode_rows_per_step']:.1f} decode rows per step,"
        f" model {r['model_s']:.1f} of {r['wall_s']:.1f} s; CPU per output token: {threads}",
        file=sys.stderr,
        flush=True,
    )
    print(run_delay.lines(run_delay.summary(r["cpu"], r["steps"])), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    vias = args.via.split(",")
    if set(vias) - set(VIAS):
        raise SystemExit(f"closed-loop: --via: choose from {','.join(VIAS)}")
    if len(vias) == 1 and args.repeats == 1:
        return {"settings": {**vars(args), "engine": ENGINE_LIMITS}, "results": [run_one(args, vias[0])]}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):  # each run a process of its own, the vias alternated
            for via in vias if rep % 2 == 0 else vias[::-1]:
                out = Path(tmp) / f"{via}-{rep}.json"
                subprocess.run([*command("closed-loop"), *_flags(args), f"--via={via}", f"--out={out}"], check=True)
                results += json.loads(out.read_text())["results"]
    medians = {via: statistics.median(r["output_tok_s"] for r in results if r["via"] == via) for via in vias}
    print("medians: " + ", ".join(f"{v} {m:.1f} tok/s" for v, m in medians.items()), file=sys.stderr)
    return {"settings": {**vars(args), "engine": ENGINE_LIMITS}, "results": results, "median_tok_s": medians}


def _flags(args: argparse.Namespace) -> list[str]:
    """This run's workload and model as flags, for a child process that measures one via."""
    keys = "model dtype concurrency num_requests warmup_load input_len output_len token_range seed".split()
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys if getattr(args, k) is not None]


def run_one(args: argparse.Namespace, via: str) -> dict:
    """One measured run in this process. All torch work runs on one thread (libgomp gives each
    thread its own team: `EngineLoop.launch`), the main thread for `engine`, the loop's for `loop`."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    lengths = _pair(args.input_len), _pair(args.output_len), _pair(args.token_range)
    specs = make_workload(args.num_requests, args.seed, *lengths)
    warm = make_workload(args.warmup_load, args.seed + 2, *lengths)

    def build() -> Engine:
        model, tokenizer = load_model_and_tokenizer(args.model or default_model_path(), dtype, torch.device("cpu"))
        return Engine.from_model(model, tokenizer, dtype=args.dtype, **ENGINE_LIMITS)

    if via == "engine":
        result = measure(via, build(), None, args, warm, specs)
    else:
        loop = EngineLoop.launch(build)
        try:
            result = measure(via, loop.engine, loop, args, warm, specs)
        finally:
            loop.shutdown()
    _print(result)
    return result

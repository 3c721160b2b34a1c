"""The engine's host work per step, measured without a GPU: the model and sampler are a stub device.

    orcaserve-bench host [--seqs 32 64 128 256 512] [--device-ms 1 2 5] [--steps 100] [--final-only 0.5]

The real `Engine` (scheduler, KV manager, step buffers, postprocess, detokenizer, SmolLM2's
tokenizer) runs with its model forward and sampler replaced by `StubDevice`: a step launched on it
takes `D` ms of wall time, starting when the previous one ends, and the host waits for it only
where it reads the sampled ids back (a sleep, which releases the GIL, as a GPU kernel leaves the
host free). With D = 0 the step's wall time is the host work a GPU would wait on; with D > 0 the
achieved step time (mean) is printed beside max(host, D), what a perfect overlap gives, for the engine
as configured (`--async-scheduling on|off|both`). Every request decodes (`ignore_eos`, a long
`max_tokens`); the stub samples a token from the request's length and arrival, so its answer
does not depend on the batch nor on the overlap. By default every request streams (an output
per step, the most host work); `--final-only` makes a share of them non-streaming clients'.
See docs/host-overlap.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import zlib
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from orcaserve.scheduler import Engine, RequestOutputKind, SamplingParams, default_model_path
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.model.step_buffers import StepBuffers

PROMPT_LEN = 16


@functools.lru_cache(maxsize=65536)
def _id_hash(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


_request_id = attrgetter("request_id")


def stub_tokens(lengths: np.ndarray, id_hashes: np.ndarray) -> np.ndarray:  # [S] int64 -> [S] int64
    """The stub's samples: for each row a plain vocabulary entry picked from its request's length
    (tokens including the one being sampled from) and its id's hash."""
    return 300 + (lengths * 7919 + id_hashes) % 20000


class StubDevice:
    """A device whose steps take `step_s` seconds each, queued one after another as on a stream."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.busy_until = 0.0

    def launch(self) -> float:
        """Queue one step; when it will be done."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        return self.busy_until

    @staticmethod
    def wait(until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)  # releases the GIL, as waiting on a GPU event does


class StubSampler:
    """The sampler's place: ids from `stub_tokens`, on the "device" (`sample`), or read back at
    once after waiting for the step (`__call__`, the synchronous contract).

    As a GPU's sampler, it reads the step's inputs as arrays, not the requests: each sampling
    row's length is its request's `seq_lens` entry in the step buffers `prepare` just wrote. The
    ids' hashes are per request, computed again only when the batch's requests change (a
    comparison by identity, in C): what the benchmark measures is the engine's work, not the
    stub's (a GPU's sampling is a few kernel launches)."""

    def __init__(self, device: StubDevice, pending: list[float], buffers: StepBuffers) -> None:
        self.device, self.pending, self.buffers = device, pending, buffers
        self.num_seqs = 0  # B of the step `prepare` wrote last (set by the stub's `execute`)
        self._reqs: list[Request] = []
        self._hashes = np.zeros(0, dtype=np.int64)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:  # [S] int64
        if reqs != self._reqs:
            self._reqs = list(reqs)
            self._hashes = np.fromiter(map(_id_hash, map(_request_id, reqs)), dtype=np.int64, count=len(reqs))
        npb, s, b = self.buffers.np, len(reqs), self.num_seqs
        # Each sampling row's request: the one whose tokens end at the row (cu_seqlens_q).
        owner = np.searchsorted(npb["cu"][1 : b + 1], npb["rows"][:s] + 1)  # [S]
        return torch.from_numpy(stub_tokens(npb["seq_lens"][owner].astype(np.int64), self._hashes))

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        self.device.wait(self.pending.pop(0))
        return self.sample(logits, reqs).tolist()


def install_stub(engine: Engine, device: StubDevice) -> None:
    """Replace the engine's forward and sampler by the stub device; the step buffers still fill."""
    runner = engine.runner
    pending: list[float] = []  # when each launched step is done, oldest first
    sampler = StubSampler(device, pending, runner.buffers)

    def execute(sched: SchedulerOutput, kv: KVCacheManager, *rest: Any, **kw: Any) -> torch.Tensor:
        shape = runner.buffers.prepare(sched, kv)  # the real host-side input building
        sampler.num_seqs = shape.num_seqs
        runner.buffers.upload(shape)  # on the CPU: the placeholders' patch only
        pending.append(device.launch())
        return torch.empty(len(sched.sampling), 0)  # [S, 0] no logits: the stub samples alone

    def to_host(tokens: torch.Tensor) -> Callable[[], list[int]]:
        until = pending.pop(0)

        def wait() -> list[int]:
            device.wait(until)
            return tokens.tolist()

        return wait

    runner.execute = execute
    runner.to_host = to_host
    engine.sampler = sampler


@functools.cache
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def build_engine(num_seqs: int, max_steps: int, tokenizer: Any = None, **engine_args: Any) -> Engine:
    """An engine around SmolLM2's tokenizer and a one-layer model of its vocabulary (never run)."""
    from orcaserve.bench.models.tiny import stub_model

    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    model = stub_model(len(tokenizer), max_position_embeddings=4096)
    tokens = num_seqs * (PROMPT_LEN + max_steps + 64)
    return Engine.from_model(
        model,
        tokenizer,
        dtype="float32",
        attention_backend="torch",  # never called: the stub runs no attention, and builds nothing
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(512, num_seqs),
        kv_cache_memory=tokens * 2 * 16 * 4 * 2,
        **engine_args,
    )


def measure(engine: Engine, num_seqs: int, steps: int, final_only: float = 0.0) -> tuple[list[float], list[float]]:
    """Wall times and the engine thread's CPU times (ms) of `steps` steps with all `num_seqs`
    requests decoding, the share `final_only` of them (spread evenly) asking for their final
    output alone (`RequestOutputKind.FINAL_ONLY`, a non-streaming client), the others for one
    per step. CPU time is what the host spent whatever else the machine runs; wall time
    includes waiting for the stub device (and, on a loaded machine, for a core)."""
    streamed = SamplingParams(max_tokens=100_000, ignore_eos=True)
    answered = SamplingParams(max_tokens=100_000, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(num_seqs):
        params = answered if int((i + 1) * final_only) > int(i * final_only) else streamed
        engine.add_request(f"h{i}", [300 + (i * 31 + j) % 5000 for j in range(PROMPT_LEN)], params)
    sched = engine.scheduler
    while len(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    for i in range(num_seqs):
        engine.abort(f"h{i}")
    while engine.has_unfinished():
        engine.step()
    return wall, cpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--device-ms", type=float, nargs="+", default=[1.0, 2.0, 5.0])
    parser.add_argument("--overlap-seqs", type=int, default=256, help="sequences of the D > 0 runs")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--async-scheduling", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--final-only",
        type=float,
        default=0.0,
        help="share of the requests answered once finished (FINAL_ONLY: no output per step); 0: all stream",
    )


def _modes(choice: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [False, True]}[choice]


def run(args: argparse.Namespace) -> dict:
    if not 0.0 <= args.final_only <= 1.0:
        raise SystemExit(f"--final-only is a share in [0, 1], got {args.final_only}")
    torch.set_num_threads(1)
    print(f"requests streaming: {1 - args.final_only:.0%}, answered once finished (final only): {args.final_only:.0%}")
    host: dict[str, dict[int, dict[str, float]]] = {}
    overlap: dict[str, dict[str, dict[str, float]]] = {}
    for on in _modes(args.async_scheduling):
        mode = "async" if on else "sync"
        extra = {"async_scheduling": True} if on else {}
        host[mode] = {}
        for n in args.seqs:
            engine = build_engine(n, args.steps + 16, **extra)
            install_stub(engine, StubDevice(0.0))
            wall, cpu = measure(engine, n, args.steps, args.final_only)
            host[mode][n] = {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu)}
            print(
                f"{mode:5s} host work per step, {n:4d} seqs: p50 wall {host[mode][n]['wall_ms']:.3f} ms, "
                f"cpu {host[mode][n]['cpu_ms']:.3f} ms",
                flush=True,
            )
        n = args.overlap_seqs
        overlap[mode] = {}
        engine = build_engine(n, (args.steps + 16) * (len(args.device_ms) + 1), **extra)
        device = StubDevice(0.0)
        install_stub(engine, device)
        base = statistics.fmean(measure(engine, n, args.steps, args.final_only)[0])
        for d in args.device_ms:
            device.step_s = d / 1e3
            # The mean, not the median: with the overlap a step that waited long is followed by
            # one that finds its ids ready, and only the mean is the rate steps complete at.
            step = statistics.fmean(measure(engine, n, args.steps, args.final_only)[0])
            bound = max(base, d)
            overlap[mode][str(d)] = {"step_ms": step, "host_ms": base, "bound_ms": bound}
            print(f"{mode:5s} D={d:g} ms, {n} seqs: step mean {step:.3f} ms (max(host, D) = {bound:.3f})", flush=True)
    return {"host_per_step": host, "overlap": overlap, "steps": args.steps, "final_only": args.final_only}

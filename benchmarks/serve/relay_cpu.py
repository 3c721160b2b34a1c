"""The worker's asyncio thread per streamed output token, without a model or TorchServe's frontend.

    orcaserve-bench relay                    # 32 closed-loop clients, 192 streamed requests of 64 tokens
    orcaserve-bench relay --profile 25       # and the thread's 25 costliest functions (cProfile)

The handler (`OrcaHandler.handle`) serves streamed completions as over HTTP (the peers' load:
`stream_options.include_usage`, token-id prompts) from scripted outputs, one token a stream per
step, that a thread hands over as the engine loop does (`request_stream.deliver`); the frames go
to a socket pair locked and observed as a supervised worker's (`socket_lock`, the supervisor's
`SupervisorLink`), and each answer's final frame is encoded and written as TorchServe's `predict`
and its sender thread do. Counted: the asyncio thread's CPU (`time.thread_time`) per output token, the number a
load's probe prints for the worker's `python` thread, less TorchServe's own per-request work and
the frontend's messages (docs/serving.md, "The asyncio thread per streamed token").
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import mmap
import os
import pstats
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.metrics import EngineMetrics
from orcaserve.handler.orca_handler import OrcaHandler
from orcaserve.handler.supervisor.link import SupervisorLink
from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.stream_frames import StreamFrames
from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes
from orcaserve.scheduler.serving.request_stream import RequestStream, deliver

# What a small model's tokens decode to: words, a quote and a newline that JSON escapes.
WORDS = [" the", " model", "'s", " answer", ",", " and", ' "quoted"', "\n", " é", " 42", "."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=192, help="measured requests (after as many as clients to warm up)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    p.add_argument("--step-ms", type=float, default=4.0, help="the scripted engine's time a step")
    p.add_argument("--profile", type=int, default=0, help="print the asyncio thread's N costliest functions")


class ScriptedLoop:
    """What the handler uses of an `EngineLoop`: `submit` gives a real `RequestStream`; a thread
    steps every `step_s`, one token to each stream, the last one finished with the whole text."""

    alive = True

    def __init__(self, step_s: float) -> None:
        self.engine = SimpleNamespace(max_model_len=1 << 16)
        self.step_s = step_s
        self._new: list[tuple[RequestStream, int]] = []
        self._lock = threading.Lock()
        self.stop = threading.Event()

    def submit(self, request: Any, event_loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        stream = RequestStream(request.request_id, event_loop, request.params.n)
        with self._lock:
            self._new.append((stream, request.params.max_tokens))
        return stream

    def abort(self, request_id: str) -> None:
        pass

    def run(self) -> None:
        live: list[list[Any]] = []  # [stream, tokens so far, max tokens, arrival]
        while not self.stop.is_set():
            with self._lock:
                live += [[s, 0, m, time.time()] for s, m in self._new]
                self._new.clear()
            items: list[tuple[RequestStream, RequestOutput]] = []
            now = time.time()
            for entry in live:
                stream, k, most, arrival = entry
                entry[1] = k = k + 1
                done = k >= most
                text = "".join(WORDS[i % len(WORDS)] for i in range(k)) if done else ""
                times = RequestTimes(arrival, arrival, arrival, now if done else None)
                out = RequestOutput(
                    stream.request_id, [k], list(range(k)) if done else [], WORDS[(k - 1) % len(WORDS)], text,
                    done, "length" if done else None, 100, k, times,
                )  # fmt: skip
                items.append((stream, out))
            live = [e for e in live if e[1] < e[2]]
            if items:
                deliver(items)
            time.sleep(self.step_s)


class WorkerSocket:
    """The worker's end of TorchServe's socket as a supervised worker has it: locked, observed by
    a supervisor's link (its events to a pipe), what is written drained by threads."""

    def __init__(self) -> None:
        self.sock, self._frontend = socket.socketpair()
        socket_lock.install(self.sock)
        events_r, events_w = os.pipe()
        self._events = events_r
        socket_lock.observe(SupervisorLink(events_w, mmap.mmap(-1, 1), socket.socket()))
        self.bytes = 0
        self._threads = [
            threading.Thread(target=self._drain, daemon=True),
            threading.Thread(target=self._pipe, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _drain(self) -> None:
        while chunk := self._frontend.recv(1 << 16):
            self.bytes += len(chunk)

    def _pipe(self) -> None:
        while os.read(self._events, 1 << 16):
            pass

    def close(self) -> None:
        socket_lock.observe(None)
        self.sock.shutdown(socket.SHUT_WR)
        self._threads[0].join(10)
        self.sock.close()
        self._frontend.close()


def _handler(loop: ScriptedLoop) -> OrcaHandler:
    handler = OrcaHandler()
    handler.config = HandlerConfig("unused", {})
    handler.initialized, handler.model_name = True, "m"
    handler.metrics = EngineMetrics(None, "m")
    handler._frames = StreamFrames(handler.config.max_frame_bytes)
    handler.engine_loop = loop
    return handler


async def _serve(handler: OrcaHandler, sock: socket.socket, n: int, clients: int, tokens: int, tag: str) -> None:
    from ts.context import Context, RequestProcessor
    from ts.protocol.otf_message_handler import create_predict_response

    left = list(range(n))
    body = {"prompt": list(range(100, 164)), "max_tokens": tokens, "temperature": 0.0, "stream": True}
    raw = json.dumps(body | {"ignore_eos": True, "stream_options": {"include_usage": True}}).encode()

    async def client() -> None:
        while left:
            rid = f"{tag}-{left.pop()}"
            ctx = Context("m", "/tmp", {}, 1, None, "0.12")
            ctx.request_ids = {0: rid}
            ctx.request_processor = [RequestProcessor({"url_path": "v1/completions"})]
            ctx.cl_socket = sock
            ret = await handler.handle([{"body": bytearray(raw)}], ctx)
            sock.sendall(create_predict_response(ret, ctx.request_ids, "Prediction success", 200, context=ctx))

    await asyncio.gather(*(client() for _ in range(clients)))


def run(args: argparse.Namespace) -> dict:
    loop = ScriptedLoop(args.step_ms / 1e3)
    stepper = threading.Thread(target=loop.run, name="scripted-engine", daemon=True)
    stepper.start()
    handler, worker = _handler(loop), WorkerSocket()
    profile = cProfile.Profile() if args.profile else None

    async def main() -> float:
        await _serve(handler, worker.sock, args.clients, args.clients, args.tokens, "warm")
        if profile is not None:
            profile.enable()
        cpu = time.thread_time()
        await _serve(handler, worker.sock, args.requests, args.clients, args.tokens, "r")
        cpu = time.thread_time() - cpu
        if profile is not None:
            profile.disable()
        return cpu

    wall = time.perf_counter()
    cpu = asyncio.run(main())
    wall = time.perf_counter() - wall
    loop.stop.set()
    stepper.join()
    worker.close()
    tokens = args.requests * args.tokens
    result = {
        "clients": args.clients,
        "requests": args.requests,
        "output_tokens": tokens,
        "asyncio_cpu_s": round(cpu, 4),
        "us_per_token": round(1e6 * cpu / tokens, 2),
        "bytes": worker.bytes,
    }
    print(f"asyncio thread: {result['us_per_token']} us of CPU per output token ({tokens} tokens, {wall:.1f} s wall)")
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
    return result

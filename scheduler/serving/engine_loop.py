"""Background thread that owns the engine; other threads talk to it through queues."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orcaserve.scheduler.core.stats_snapshot import StatsSnapshot
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import EngineError, InternalError, TargetUnreachable
from orcaserve.scheduler.serving.admission import Abort, Admission, Submission
from orcaserve.scheduler.serving.in_flight import InFlight
from orcaserve.scheduler.serving.loop_call import LoopCall
from orcaserve.scheduler.serving.loop_end import answer_all
from orcaserve.scheduler.serving.loop_requests import end_early, take_in
from orcaserve.scheduler.serving.os_thread import name_spawned_threads, name_this_thread
from orcaserve.scheduler.serving.request_stream import RequestStream, deliver
from orcaserve.scheduler.serving.stream_table import StreamTable

log = logging.getLogger(__name__)

_STOP = object()


class EngineLoop:
    """Runs `engine.step()` while there is work; otherwise blocks on its inbox until a request,
    an abort, a shutdown or the nearest deadline.

    `submit` and `abort` may be called from any thread. Prompts are tokenized on the admission
    thread (`admission.py`), never on this one. The loop thread is the only one that touches the
    engine, so the scheduler needs no locks. `on_step(snapshot)` (the engine's, with the loop's
    `num_waiting`) runs on the loop thread after each step and after aborts (for metrics).
    Nothing a request carries ends the thread: admission failures fail that request, step
    failures the step's requests. Should the thread die anyway (a bug), every request in flight
    is answered (`loop_end.py`) and `on_death(error)` runs.

    `max_waiting` bounds the sequences that will wait: those submitted beyond the engine's
    `max_num_seqs` seats (a request with `n` choices is n of them), wherever they are (admission,
    the engine's queue, a prompt job). A burst of up to `max_num_seqs + max_waiting` sequences is
    accepted; beyond it `submit` raises `Overloaded` at once instead of queueing without limit
    (docs/serving.md, "Limits and refusals"). `num_waiting` is what waits now: accepted and not
    running. Requests fail with the errors of `scheduler/errors.py`; `on_refused(error)` runs for
    each request refused before it ran (on the submitting thread or the loop thread), and
    `refused` counts them by the error's `reason` (the count and the bound: `in_flight.py`; the
    requests in the engine and their outboxes: `stream_table.py`).
    """

    def __init__(
        self,
        engine: Engine | None,
        on_step: Callable[[StatsSnapshot], None] | None = None,
        max_waiting: int | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        on_refused: Callable[[EngineError], None] | None = None,
    ) -> None:
        self._engine = engine
        self.on_step = on_step
        self.on_death = on_death
        self._in_flight = InFlight(max_waiting, on_refused)  # shared with submitters, under its lock
        self.refused = self._in_flight.refused  # requests refused before they ran, by reason
        self._inbox: queue.Queue = queue.Queue()
        self._table = StreamTable(self._in_flight)  # the loop thread's alone
        self._num_running = 0  # published by the loop thread after each step
        self._build: Callable[[], Engine] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._admission = None if engine is None else self._new_admission(engine)
        self._thread = threading.Thread(target=self._run, name="orcaserve-engine", daemon=True)
        self._workers_named = False  # the OpenMP workers this thread started, named after its first step

    def start(self) -> EngineLoop:
        if self._admission is not None:
            self._admission.start()  # requests submitted before the start share the first step
        self._thread.start()
        return self

    def _new_admission(self, engine: Engine) -> Admission:
        tokenizer = copy.deepcopy(engine.tokenizer)  # its own: fast tokenizers are not thread-safe
        return Admission(tokenizer, engine.vocab_size, engine.max_model_len, self._inbox.put, grammars=engine.grammars)

    @classmethod
    def launch(
        cls,
        build: Callable[[], Engine],
        on_step: Callable[[StatsSnapshot], None] | None = None,
        max_waiting: int | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        on_refused: Callable[[EngineError], None] | None = None,
    ) -> EngineLoop:
        """Build the engine on the loop thread itself, then serve; raises what `build` raises.

        libgomp gives every thread that runs a parallel region its own team of workers, and once
        a process holds more OpenMP threads than there are cores, all teams cut their spin-wait
        and sleep in futexes between ops (docs/engine.md, "One thread for all torch work"); one
        thread for all torch work, loading included, avoids it.
        """
        loop = cls(None, on_step, max_waiting, on_death, on_refused)
        loop._build = build
        loop.start()
        loop._built.wait()
        if loop._build_error is not None:
            loop._thread.join()
            raise loop._build_error
        return loop

    @property
    def engine(self) -> Engine:
        """The engine this loop runs (built by the time `launch` returns)."""
        if self._engine is None:
            raise RuntimeError("the engine is not built yet")
        return self._engine

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread and wait for it; requests in flight or still queued end with
        `ShuttingDown`."""
        self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._in_flight.closed

    @property
    def max_waiting(self) -> int | None:
        return self._in_flight.max_waiting

    @property
    def num_in_flight(self) -> int:
        return self._in_flight.count

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and not running, wherever they wait (admission, the engine's queue,
        a prompt job): the queue a router should see. Exact after each step (`on_step`)."""
        return max(0, self._in_flight.count - self._num_running)

    def submit(self, request: EngineRequest, event_loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue `request` (its fields: `EngineRequest`; its `timeout` is enforced here); its
        outputs (or an EngineError) arrive on the returned stream, read from a thread, or from
        `event_loop`'s coroutines when given.

        Raises `ShuttingDown` at once if the loop is shut down, `Overloaded` if the waiting queue
        is full.
        """
        stream = RequestStream(request.request_id, event_loop, request.params.n)
        deadline = time.time() + request.timeout if request.timeout is not None else None
        seats = None if self._admission is None or self._engine is None else self._engine.config.max_num_seqs
        self._in_flight.admit(request.params.n, seats)  # raises ShuttingDown or Overloaded
        self._enqueue(Submission(stream, request, deadline))
        return stream

    def abort(self, request_id: str) -> None:
        self._enqueue(Abort(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run `fn(engine)` on the loop thread between steps (loop_call.py); the future holds its
        result or exception (`ShuttingDown` if the loop ends first)."""
        call = LoopCall(fn)
        self._inbox.put(call)
        return call.future

    def _enqueue(self, item: Submission | Abort) -> None:
        if self._admission is not None:  # else not started: nothing to abort yet
            self._admission.put(item)

    # ---- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        name_this_thread("orca-engine")
        death: BaseException | None = None
        try:
            if self._build is not None:
                try:
                    self._engine = self._build()
                    self._admission = self._new_admission(self._engine).start()
                except BaseException as e:
                    self._build_error = e  # launch() re-raises it on its thread
                    self._in_flight.close()
                    return
                finally:
                    self._built.set()
            self._serve()
        except BaseException as e:
            log.critical("orcaserve engine loop died", exc_info=True)
            death = e
        self._close(death)
        if death is not None and self.on_death is not None:
            self.on_death(death)

    def _serve(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            items = self._drain(block=not busy)
            for i, item in enumerate(items):
                if item is _STOP:
                    for rest in items[i + 1 :]:  # admission may hand requests on after the stop
                        self._inbox.put(rest)  # `_close` answers them
                    return
                self._handle(item)
            self._expire_deadlines()
            if self.engine.has_unfinished():
                self._step()
                if not self._workers_named:  # by now this thread's OpenMP team exists
                    self._workers_named = True
                    name_spawned_threads("orca-omp")
            self._flush()

    def _flush(self) -> None:
        if outbox := self._table.take():
            deliver(outbox)

    def _drain(self, block: bool) -> list:
        """Everything in the inbox; when idle, wait for the first item or the nearest deadline."""
        items = []
        try:
            if block:
                wait = self._table.nearest_deadline()
                items.append(self._inbox.get(timeout=None if wait is None else max(0.0, wait - time.time())))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _handle(self, item: Submission | Abort | LoopCall) -> None:
        if isinstance(item, LoopCall):
            item.run(self.engine)
            self._notify()
            return
        if isinstance(item, Abort):
            self._end_early(item.request_id, "abort", None)
            return
        take_in(self.engine, self._table, item, self._notify)

    def _end_early(self, rid: str, reason: str, error: EngineError | None) -> None:
        end_early(self.engine, self._table, rid, reason, error, self._notify)  # loop_requests.py

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, (deadline, _) in list(self._table.deadlines.items()):
            if now >= deadline:
                self._end_early(rid, "timeout", None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the scheduler itself failed: its state cannot be trusted
            log.exception("engine step failed outside the model; failing every request in flight")
            for rid in list(self._table.streams):
                self._end_early(rid, "error", InternalError(f"internal error: {type(e).__name__}: {e}"))
            return
        # First tokens go out first: the event loop writes a step's frames one after another, on a
        # core it shares with the engine, and a new request's first token would otherwise come
        # last in a step of many streams (measured: docs/performance-log.md
        # #2026-12-04-amx-prefill-attention-one-pass-element-wise-ops-first-tokens-first-sapphire-rapids).
        # Each stream still sees its outputs in order.
        outputs.sort(key=lambda out: out.completion_tokens > len(out.new_token_ids))
        streams = self._table.streams
        for out in outputs:
            rid = out.request_id
            if out.error is not None:  # one choice failed: the request fails, its other choices end
                self._end_early(rid, "error", InternalError(f"internal error: {out.error}"))
            elif out.finish_reason == "rejected":  # its class refuses a TTFT it cannot make
                self._end_early(rid, "rejected", TargetUnreachable())
            elif (stream := streams.get(rid)) is None:
                continue
            elif out.finished:
                self._table.choice_done(rid, out)
            else:
                self._table.send(stream, out)
        self._num_running = self.engine.scheduler.num_running
        self._notify()

    def _notify(self) -> None:
        if self.on_step is None:
            return
        try:
            # What waits is the loop's count (admission included), not only the engine's queue.
            self.on_step(dataclasses.replace(self.engine.snapshot(), num_waiting=self.num_waiting))
        except Exception:
            log.exception("on_step callback failed")

    def _close(self, death: BaseException | None) -> None:
        """Answer everything in flight and everything still queued; refuse new submissions."""
        self._in_flight.close()  # no submission enters admission after this
        if self._admission is not None:
            self._admission.close()  # what it still holds lands in the inbox, answered below
        answer_all(self._table, self._engine, self._inbox, death)
        self._flush()

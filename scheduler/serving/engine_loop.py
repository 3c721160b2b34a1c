"""Background thread that owns the engine; other threads talk to it through queues."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.core.stats_snapshot import StatsSnapshot
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import (
    EngineError,
    InternalError,
    InvalidRequest,
    Overloaded,
    ShuttingDown,
    TargetUnreachable,
    TimedOut,
)
from orcaserve.scheduler.serving.admission import Abort, Admission, Submission
from orcaserve.scheduler.serving.os_thread import name_this_thread
from orcaserve.scheduler.serving.request_stream import RequestStream, deliver

log = logging.getLogger(__name__)


_STOP = object()
# Retry-after hint (seconds) for requests refused because this engine stopped: a supervised
# worker is replaced, or another serves the retry.
_RESTART_S = 5


class EngineLoop:
    """Runs `engine.step()` while there is work; otherwise blocks on its inbox until a request,
    an abort, a shutdown or the nearest deadline.

    `submit` and `abort` may be called from any thread. Prompts are tokenized on the admission
    thread (`admission.py`), never on this one. The loop thread is the only one that touches the
    engine, so the scheduler needs no locks. `on_step(snapshot)` (the engine's, with the loop's
    `num_waiting`) runs on the loop
    thread after each step and after aborts (for metrics). Nothing a request carries ends the
    thread: admission failures fail that request, step failures the step's requests. Should the
    thread die anyway (a bug), every request in flight is answered and `on_death(error)` runs.

    `max_waiting` bounds the sequences that will wait: those submitted beyond the engine's
    `max_num_seqs` seats (a request with `n` choices is n of them), wherever they are (admission,
    the engine's queue, a prompt job). A burst of up to `max_num_seqs + max_waiting` sequences is
    accepted; beyond it `submit` raises `Overloaded` at once instead of queueing without limit
    (docs/serving.md, "Limits and refusals"). `num_waiting` is what waits now: accepted and not
    running. Requests fail with the errors of `scheduler/errors.py`; `on_refused(error)` runs for
    each request refused before it ran (on the submitting thread or the loop thread), and
    `refused` counts them by the error's `reason`.
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
        self.on_refused = on_refused
        self.refused: Counter[str] = Counter()  # requests refused before they ran, by reason
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._outbox: list[tuple[RequestStream, RequestOutput | EngineError]] = []  # flushed once per round
        self._deadlines: dict[str, tuple[float, float]] = {}  # id -> (deadline, timeout)
        self._lock = threading.Lock()  # guards _closed, _in_flight and refused against submitters
        self._closed = False
        self._in_flight = 0  # sequences submitted and not finished (a finished choice leaves at once)
        self._num_running = 0  # published by the loop thread after each step
        self._unfinished: dict[str, int] = {}  # request id -> its choices not yet finished
        self._begun: set[str] = set()  # request ids that have had an output: no longer refusable
        self._build: Callable[[], Engine] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._admission = None if engine is None else self._new_admission(engine)
        self._thread = threading.Thread(target=self._run, name="orcaserve-engine", daemon=True)

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
        return self._thread.is_alive() and not self._closed

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and not running, wherever they wait (admission, the engine's queue,
        a prompt job): the queue a router should see. Exact after each step (`on_step`)."""
        return max(0, self._in_flight - self._num_running)

    def submit(self, request: EngineRequest, event_loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue `request` (its fields: `EngineRequest`; its `timeout` is enforced here); its
        outputs (or an EngineError) arrive on the returned stream, read from a thread, or from
        `event_loop`'s coroutines when given.

        Raises `ShuttingDown` at once if the loop is shut down, `Overloaded` if the waiting queue
        is full.
        """
        request_id, params, timeout = request.request_id, request.params, request.timeout
        request_id, params, timeout = request.request_id, request.params, request.timeout
        stream = RequestStream(request_id, event_loop, params.n)
        deadline = time.time() + timeout if timeout is not None else None
        with self._lock:
            if self._closed or self._admission is None or self._engine is None:
                raise self._refuse(ShuttingDown("the engine is not running", retry_after=_RESTART_S))
            # What will wait is what the engine's seats cannot take: running or not yet, every
            # sequence in flight holds a seat or a place in the queue (docs/serving.md, "Limits
            # and refusals").
            seats = self._engine.config.max_num_seqs
            waiting = max(0, self._in_flight - seats)
            if self.max_waiting is not None and self._in_flight + params.n - seats > self.max_waiting:
                raise self._refuse(
                    Overloaded(
                        f"server overloaded: {waiting} sequences are already waiting "
                        f"(max_waiting_requests={self.max_waiting}); retry later",
                        retry_after=1,
                    )
                )
            self._in_flight += params.n
            self._enqueue(Submission(stream, request, deadline))
        return stream

    def abort(self, request_id: str) -> None:
        self._enqueue(Abort(request_id))

    def _refuse(self, error: EngineError) -> EngineError:
        """Count `error` as a request refused before it ran (callers hold the lock or are the loop
        thread), tell `on_refused`, and return it."""
        self.refused[error.reason] += 1
        if self.on_refused is not None:
            try:
                self.on_refused(error)
            except Exception:
                log.exception("on_refused callback failed")
        return error

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
                    self._closed = True
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
            self._flush()

    def _flush(self) -> None:
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            deliver(outbox)

    def _drain(self, block: bool) -> list:
        """Everything in the inbox; when idle, wait for the first item or the nearest deadline."""
        items = []
        try:
            if block:
                wait = min((d for d, _ in self._deadlines.values()), default=None)
                items.append(self._inbox.get(timeout=None if wait is None else max(0.0, wait - time.time())))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _handle(self, item: Submission | Abort) -> None:
        if isinstance(item, Abort):
            self._end_early(item.request_id, "abort", None)
            return
        rid = item.stream.request_id
        if rid in self._streams:
            self._finish_stream(item.stream, InvalidRequest(f"request id {rid!r} is already in flight"))
            return
        if item.error is not None or item.ids is None:  # never tokenize here: admission did, or failed
            self._finish_stream(item.stream, item.error or InternalError("internal error: prompt not prepared"))
            if isinstance(item.error, TimedOut):  # its deadline passed in admission:
                self.engine.stats.num_aborted += 1  # an abort by deadline, counted as the engine's own
                self._notify()
            return
        try:
            self.engine.add_request(dataclasses.replace(item.request, prompt=item.ids))  # tokenized
        except InvalidRequest as e:
            self._finish_stream(item.stream, e)
            return
        except Exception as e:  # a bug or an input nobody foresaw: this request fails, not the loop
            log.exception("request %s could not be admitted", rid)
            self._finish_stream(
                item.stream, InternalError(f"internal error while admitting the request: {type(e).__name__}: {e}")
            )
            return
        self._streams[rid] = item.stream
        self._unfinished[rid] = item.request.params.n
        if item.deadline is not None:
            self._deadlines[rid] = (item.deadline, item.request.timeout or 0.0)

    def _finish_stream(self, stream: RequestStream, item: RequestOutput | EngineError, seqs: int | None = None) -> None:
        """Queue a stream's final item and release its `seqs` unfinished sequences (all of its
        choices by default) from the in-flight count; an error before any output is a refusal."""
        self._outbox.append((stream, item))
        with self._lock:
            self._in_flight -= stream.n if seqs is None else seqs
            if isinstance(item, EngineError) and stream.request_id not in self._begun:
                self._refuse(item)

    def _deliver(self, rid: str, item: RequestOutput | EngineError) -> None:
        """Send `rid` its final item and forget it."""
        stream = self._streams.pop(rid, None)
        self._deadlines.pop(rid, None)
        seqs = self._unfinished.pop(rid, None)
        if stream is not None:
            self._finish_stream(stream, item, seqs)
        self._begun.discard(rid)

    def _choice_done(self, rid: str, out: RequestOutput) -> None:
        """A choice's final output: the request's final item once every choice has finished."""
        left = self._unfinished.get(rid, 1) - 1
        if left > 0:
            self._unfinished[rid] = left
            self._begun.add(rid)
            self._outbox.append((self._streams[rid], out))
            with self._lock:
                self._in_flight -= 1  # its seat is free for the next arrival
        else:
            self._deliver(rid, out)

    def _end_early(self, rid: str, reason: str, error: EngineError | None) -> None:
        """Abort `rid` (every choice) in the engine, freeing its blocks, and answer it with the
        final outputs of its unfinished choices, or with `error` when given."""
        outs = self.engine.abort_all(rid, reason)
        stream = self._streams.get(rid)
        if stream is None:
            return
        untouched = self._unfinished.get(rid) == stream.n and all(o.completion_tokens == 0 for o in outs)
        if error is None and outs and reason == "timeout" and untouched:
            timeout = self._deadlines[rid][1]
            error = TimedOut(timeout)
        if error is None and not outs:  # the engine no longer knows it: answer anyway
            error = InternalError(f"internal error: request {rid} was lost by the engine")
        if error is not None:
            self._deliver(rid, error)
        else:
            for out in outs:
                self._choice_done(rid, out)
        self._notify()

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, (deadline, _) in list(self._deadlines.items()):
            if now >= deadline:
                self._end_early(rid, "timeout", None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the scheduler itself failed: its state cannot be trusted
            log.exception("engine step failed outside the model; failing every request in flight")
            for rid in list(self._streams):
                self._end_early(rid, "error", InternalError(f"internal error: {type(e).__name__}: {e}"))
            return
        # First tokens go out first: the event loop writes a step's frames one after another, on a
        # core it shares with the engine, and a new request's first token would otherwise come
        # last in a step of many streams (measured: docs/performance-log.md
        # #2026-12-04-amx-prefill-attention-one-pass-element-wise-ops-first-tokens-first-sapphire-rapids).
        # Each stream still sees its outputs in order.
        outputs.sort(key=lambda out: out.completion_tokens > len(out.new_token_ids))
        streams = self._streams
        for out in outputs:
            rid = out.request_id
            if out.error is not None:  # one choice failed: the request fails, its other choices end
                self._end_early(rid, "error", InternalError(f"internal error: {out.error}"))
            elif out.finish_reason == "rejected":  # its class refuses a TTFT it cannot make
                self._end_early(rid, "rejected", TargetUnreachable())
            elif (stream := streams.get(rid)) is None:
                continue
            elif out.finished:
                self._choice_done(rid, out)
            else:
                self._begun.add(rid)
                self._outbox.append((stream, out))
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
        with self._lock:
            self._closed = True  # no submission enters admission after this
        if self._admission is not None:
            self._admission.close()  # what it still holds lands in the inbox, answered below

        def error() -> EngineError:  # one per request: each reader raises its own
            if death is None:
                return ShuttingDown("the engine is shutting down", retry_after=_RESTART_S)
            return InternalError(
                f"the engine stopped after an internal error: {type(death).__name__}", retry_after=_RESTART_S
            )

        for rid in list(self._streams):
            try:
                if death is None and self._engine is not None:
                    self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s at shutdown failed", rid)
            self._deliver(rid, error())
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Submission):
                self._finish_stream(item.stream, ShuttingDown("the engine is shutting down", retry_after=_RESTART_S))
        self._flush()

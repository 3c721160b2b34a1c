"""Background thread that owns the engine; other threads talk to it through queues."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

_END = object()


class RequestError(Exception):
    """A request failed: `status` is the HTTP-like code (400 invalid, 408 deadline, 500 internal)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RequestStream:
    """Outputs of one request, written by the engine thread, read from a thread or asyncio.

    Iterate it (`for out in stream` or `async for out in stream`) to get `RequestOutput`s until
    the final one; a failure is raised as `RequestError`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.finished = False

    def put(self, item: RequestOutput | RequestError) -> None:
        """Called by the engine thread only."""
        if self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)
        else:
            self._sync.put(item)

    @staticmethod
    def _done(item) -> bool:
        return isinstance(item, RequestError) or item.finished

    def __iter__(self):
        while not self.finished:
            item = self._sync.get()
            self.finished = self._done(item)
            if isinstance(item, RequestError):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async is not None, "create the stream with an event loop to read it async"
        while not self.finished:
            item = await self._async.get()
            self.finished = self._done(item)
            if isinstance(item, RequestError):
                raise item
            yield item


@dataclass
class _Submit:
    stream: RequestStream
    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int
    deadline: float | None


class EngineLoop:
    """Runs `engine.step()` continuously while there is work, sleeping on its queue otherwise.

    `submit` and `abort` may be called from any thread. The loop thread is the only one that
    touches the engine, so the scheduler needs no locks. `on_step(engine)` runs on the loop
    thread after each step (for metrics).
    """

    def __init__(self, engine: Engine | None, on_step: Callable[[Engine], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._deadlines: dict[str, float] = {}
        self._stop = threading.Event()
        self._build: Callable[[], Engine] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="orcaserve-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @classmethod
    def launch(cls, build: Callable[[], Engine], on_step: Callable[[Engine], None] | None = None) -> "EngineLoop":
        """Build the engine on the loop thread itself, then serve; raises what `build` raises.

        libgomp gives every thread that runs a parallel region its own team of workers, and once
        a process holds more OpenMP threads than there are cores, all teams cut their spin-wait
        and sleep in futexes between ops. Loading the model on the caller's thread and stepping
        on this one makes two teams: 140 against 158 tok/s on the 2-core CPU. One thread for all
        torch work avoids it.
        """
        loop = cls(None, on_step)
        loop._build = build
        loop.start()
        loop._built.wait()
        if loop._build_error is not None:
            loop._thread.join()
            raise loop._build_error
        return loop

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the thread and wait for it."""
        self._stop.set()
        self._inbox.put(_END)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        timeout: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Queue a request; its outputs (or a RequestError) arrive on the returned stream."""
        stream = RequestStream(request_id, loop)
        deadline = time.time() + timeout if timeout is not None else None
        self._inbox.put(_Submit(stream, prompt, params, priority, deadline))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    # ---- loop thread -------------------------------------------------------------------------
    def _drain(self, block: bool) -> list:
        items = []
        try:
            items.append(self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _run(self) -> None:
        if self._build is not None:
            try:
                self.engine = self._build()
            except BaseException as e:  # handed to launch(), which re-raises it on its thread
                self._build_error = e
                return
            finally:
                self._built.set()
        while not self._stop.is_set():
            for item in self._drain(block=not self.engine.has_unfinished()):
                self._handle(item)
            self._expire_deadlines()
            if self.engine.has_unfinished():
                self._step()
        for rid in list(self._streams):
            self._abort(rid, RequestError(503, "the engine is shutting down"))

    def _handle(self, item) -> None:
        if item is _END:
            return
        if isinstance(item, str):
            self._abort(item, None)
            return
        rid = item.stream.request_id
        if rid in self._streams:
            item.stream.put(RequestError(400, f"request id {rid!r} is already in flight"))
            return
        try:
            self.engine.add_request(rid, item.prompt, item.params, item.priority)
        except ValueError as e:
            item.stream.put(RequestError(400, str(e)))
            return
        self._streams[rid] = item.stream
        if item.deadline is not None:
            self._deadlines[rid] = item.deadline

    def _abort(self, rid: str, error: RequestError | None) -> None:
        stream = self._streams.pop(rid, None)
        self._deadlines.pop(rid, None)
        out = self.engine.abort(rid)
        if stream is not None:
            stream.put(error if error is not None else out)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, deadline in list(self._deadlines.items()):
            if now >= deadline:
                self._abort(rid, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # keep serving: fail the requests in flight, not the loop
            log.exception("engine step failed")
            for rid in list(self._streams):
                self._abort(rid, RequestError(500, f"internal error: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._deadlines.pop(out.request_id, None)
        if self.on_step is not None:
            try:
                self.on_step(self.engine)
            except Exception:
                log.exception("on_step callback failed")

"""A request's stream of outputs from the engine thread, ended by its final output or an
`EngineError`."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import EngineError


class RequestStream:
    """Outputs of one request, written by the engine thread, read from a thread or asyncio.

    Iterate it (`for out in stream` or `async for out in stream`) to get `RequestOutput`s until
    the final one of each of its `n` choices; a failure is raised as `EngineError`.
    """

    def __init__(self, request_id: str, event_loop: asyncio.AbstractEventLoop | None = None, n: int = 1) -> None:
        self.request_id = request_id
        self.n = n
        self._unfinished = n  # choices whose final output has not been read
        self._event_loop = event_loop
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = asyncio.Queue() if event_loop is not None else None
        self.finished = False

    def put(self, item: RequestOutput | EngineError) -> None:
        """Called by the engine thread only."""
        deliver([(self, item)])

    def _done(self, item: RequestOutput | EngineError) -> bool:
        """Whether `item`, just read, ends the stream (an error, or the last choice's final output)."""
        if isinstance(item, EngineError):
            return True
        if item.finished:
            self._unfinished -= 1
        return self._unfinished == 0

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            item = self._sync.get()
            self.finished = self._done(item)
            if isinstance(item, EngineError):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for outputs in self.chunks():
            for out in outputs:
                yield out

    async def chunks(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in the order they came, as lists of all that are already waiting: a reader
        that falls behind catches up in one go (one frame to the client instead of one per token)."""
        assert self._async is not None, "submit with event_loop= to read the stream from asyncio"
        while not self.finished:
            items = [await self._async.get()]
            while not (done := self._done(items[-1])) and not self._async.empty():
                items.append(self._async.get_nowait())
            self.finished = done
            error = items.pop() if isinstance(items[-1], EngineError) else None
            if items:
                yield items  # only RequestOutputs are left
            if error is not None:
                raise error


def deliver(items: list[tuple[RequestStream, RequestOutput | EngineError]]) -> None:
    """Put items into their streams with one wake-up per event loop, not one per item (the
    engine thread delivers a whole step's outputs at once)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        if stream._async is None:
            stream._sync.put(item)
        else:
            assert stream._event_loop is not None
            by_loop.setdefault(stream._event_loop, []).append((stream._async, item))
    for event_loop, puts in by_loop.items():
        try:
            event_loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # the readers' event loop is closed: nobody is listening
            pass


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput | EngineError]]) -> None:
    for q, item in puts:
        q.put_nowait(item)

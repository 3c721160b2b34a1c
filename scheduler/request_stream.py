"""A request's stream of outputs from the engine thread, and the error that can end it."""

from __future__ import annotations

import asyncio
import queue
from typing import AsyncIterator, Iterator

from .outputs import RequestOutput


class RequestError(Exception):
    """A request failed. `status` is the HTTP status to answer with: 400 invalid request, 408
    deadline passed before the first token, 500 internal error, 503 overloaded or shutting down.
    `param` names the offending request field, if any; `retry_after` (seconds) goes with a 503
    that the client may retry."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


class RequestStream:
    """Outputs of one request, written by the engine thread, read from a thread or asyncio.

    Iterate it (`for out in stream` or `async for out in stream`) to get `RequestOutput`s until
    the final one; a failure is raised as `RequestError`.
    """

    def __init__(self, request_id: str, event_loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._event_loop = event_loop
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = asyncio.Queue() if event_loop is not None else None
        self.finished = False

    def put(self, item: RequestOutput | RequestError) -> None:
        """Called by the engine thread only."""
        if self._async is not None:
            assert self._event_loop is not None
            try:
                self._event_loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the reader's event loop is closed: nobody is listening
                pass
        else:
            self._sync.put(item)

    @staticmethod
    def _done(item: RequestOutput | RequestError) -> bool:
        return isinstance(item, RequestError) or item.finished

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            item = self._sync.get()
            self.finished = self._done(item)
            if isinstance(item, RequestError):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async is not None, "submit with event_loop= to read the stream from asyncio"
        while not self.finished:
            item = await self._async.get()
            self.finished = self._done(item)
            if isinstance(item, RequestError):
                raise item
            yield item

"""A request's stream of outputs from the engine thread, ended by its final output or an
`EngineError`."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeAlias

from orcaserve.scheduler.core.outputs import RequestOutput
from orcaserve.scheduler.errors import EngineError
from orcaserve.scheduler.serving.loop_inbox import LoopInbox

Item: TypeAlias = RequestOutput | EngineError


class RequestStream:
    """Outputs of one request, written by the engine thread, read from a thread or asyncio.

    Iterate it (`for out in stream` or `async for out in stream`) to get `RequestOutput`s until
    the final one of each of its `n` choices; a failure is raised as `EngineError`. On asyncio,
    `follow(on_outputs)` hands the outputs to a callback instead, without waking the reading
    coroutine per step (docs/serving.md, "The asyncio thread per streamed token").
    """

    def __init__(self, request_id: str, event_loop: asyncio.AbstractEventLoop | None = None, n: int = 1) -> None:
        self.request_id = request_id
        self.n = n
        self._unfinished = n  # choices whose final output has not been read
        self._event_loop = event_loop
        self._sync: queue.Queue | None = queue.Queue() if event_loop is None else None
        self._inbox = LoopInbox.of(event_loop) if event_loop is not None else None
        self._pending: list[Item] = []  # delivered on the event loop's thread, not yet read
        self._wake: asyncio.Future | None = None  # `chunks` waiting for items
        self._follower: Callable[[list[Item]], None] | None = None  # `follow`'s callback
        self.finished = False

    def put(self, item: Item) -> None:
        """Called by the engine thread only."""
        deliver([(self, item)])

    def _take(self, items: list[Item]) -> tuple[list[RequestOutput], EngineError | None]:
        """The outputs of `items`, just read, up to the one that ends the stream (an error, or the
        last choice's final output: `finished` is then set), and the error if one ended it."""
        taken: list[RequestOutput] = []
        for item in items:
            if isinstance(item, EngineError):
                self.finished = True
                return taken, item
            taken.append(item)
            if item.finished:
                self._unfinished -= 1
                if self._unfinished == 0:
                    self.finished = True
                    break
        return taken, None

    def __iter__(self) -> Iterator[RequestOutput]:
        assert self._sync is not None, "submit without event_loop= to read the stream from a thread"
        while not self.finished:
            outputs, error = self._take([self._sync.get()])
            if error is not None:
                raise error
            yield from outputs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for outputs in self.chunks():
            for out in outputs:
                yield out

    async def chunks(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in the order they came, as lists of all that are already waiting: a reader
        that falls behind catches up in one go (one frame to the client instead of one per token)."""
        assert self._event_loop is not None, "submit with event_loop= to read the stream from asyncio"
        while not self.finished:
            if not self._pending:
                self._wake = self._event_loop.create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            items, self._pending = self._pending, []
            outputs, error = self._take(items)
            if outputs:
                yield outputs
            if error is not None:
                raise error

    async def follow(self, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        """Call `on_outputs` with the outputs as `chunks` would yield them, on the event loop's
        thread, from the callback that dispatches a step's outputs to every stream: this coroutine
        wakes only when the stream ends. Raises the stream's error, or what `on_outputs` raised
        (the outputs after it are dropped)."""
        assert self._event_loop is not None, "submit with event_loop= to read the stream from asyncio"
        if self.finished:
            return
        ended = self._event_loop.create_future()

        def receive(items: list[Item]) -> None:
            if ended.done():
                return
            try:
                outputs, error = self._take(items)
                if outputs:
                    on_outputs(outputs)
                if error is not None:
                    ended.set_exception(error)
                elif self.finished:
                    ended.set_result(None)
            except Exception as e:  # the reader's: raised where it awaits
                ended.set_exception(e)

        self._follower = receive
        try:
            if self._pending:
                items, self._pending = self._pending, []
                receive(items)
            await ended
        finally:
            self._follower = None

    def _receive(self, items: list[Item]) -> None:
        """Called on the event loop's thread (`LoopInbox`): this stream's newly delivered items."""
        if self._follower is not None:
            self._follower(items)
            return
        self._pending += items
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


def deliver(items: list[tuple[RequestStream, Item]]) -> None:
    """Put items into their streams with at most one wake-up per event loop, not one per item (the
    engine thread delivers a whole step's outputs at once)."""
    by_inbox: dict[LoopInbox, list[tuple[RequestStream, Item]]] = {}
    for stream, item in items:
        if stream._inbox is None:
            assert stream._sync is not None
            stream._sync.put(item)
        else:
            by_inbox.setdefault(stream._inbox, []).append((stream, item))
    for inbox, puts in by_inbox.items():
        inbox.put(puts)

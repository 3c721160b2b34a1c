"""A request's stream of outputs from the engine thread, and the error that can end it."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator

from orcaserve.scheduler.core.outputs import RequestOutput

# Validation messages (SamplingParams, Engine.add_request) start with the offending field's name.
_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "priority",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "stop_token_ids",
        "ignore_eos",
        "cache_salt",
        "logprobs",
        "logit_bias",
    }
)


class RequestError(Exception):
    """A request failed. `status` is the HTTP status to answer with: 400 invalid request, 408
    deadline passed before the first token, 500 internal error, 503 overloaded or shutting down.
    `param` names the offending request field, if any; `retry_after` (seconds) goes with a 503
    that the client may retry."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after

    @classmethod
    def invalid(cls, message: str) -> RequestError:
        """A 400 for a validation message; `param` is its first word where that names a field."""
        first = message.split(" ", 1)[0]
        return cls(400, message, first if first in _FIELDS else None)

    @classmethod
    def timed_out(cls, timeout: float) -> RequestError:
        """A 408: the request's deadline passed before its first token."""
        return cls(408, f"request timed out after {timeout:g} s before its first token", "timeout")


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
        deliver([(self, item)])

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
        async for outputs in self.chunks():
            for out in outputs:
                yield out

    async def chunks(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in the order they came, as lists of all that are already waiting: a reader
        that falls behind catches up in one go (one HTTP frame instead of one per token)."""
        assert self._async is not None, "submit with event_loop= to read the stream from asyncio"
        while not self.finished:
            items = [await self._async.get()]
            while not self._done(items[-1]) and not self._async.empty():
                items.append(self._async.get_nowait())
            self.finished = self._done(items[-1])
            error = items.pop() if isinstance(items[-1], RequestError) else None
            if items:
                yield items  # only RequestOutputs are left
            if error is not None:
                raise error


def deliver(items: list[tuple[RequestStream, RequestOutput | RequestError]]) -> None:
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


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput | RequestError]]) -> None:
    for q, item in puts:
        q.put_nowait(item)

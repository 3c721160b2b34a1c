"""Outputs handed from the engine thread to one asyncio loop's streams: one wake-up of the loop for
whatever has piled up, and every stream's items dispatched in that one callback (docs/serving.md,
"The asyncio thread per streamed token")."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Protocol


class Receiver(Protocol):
    """What an inbox dispatches to (a `RequestStream`: request_stream.py, which imports this file)."""

    def _receive(self, items: list[Any]) -> None: ...


_INBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox] = weakref.WeakKeyDictionary()
_INBOXES_LOCK = threading.Lock()


class LoopInbox:
    """What the engine thread delivered to the streams read on one event loop, not yet dispatched.

    `put` (the engine thread) appends a step's items and schedules `_dispatch` on the loop unless
    it is already scheduled; `_dispatch` (the loop's thread) takes everything delivered by then
    and gives each stream its items in one call, in the order the engine delivered them: a loop
    that falls behind catches up on several steps at once, each stream with one batch."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(event_loop)  # the registry's key: no strong reference back
        self._lock = threading.Lock()
        self._items: list[tuple[Receiver, Any]] = []
        self._scheduled = False

    @staticmethod
    def of(event_loop: asyncio.AbstractEventLoop) -> LoopInbox:
        """The inbox of `event_loop` (one a loop, made on first use)."""
        with _INBOXES_LOCK:
            inbox = _INBOXES.get(event_loop)
            if inbox is None:
                inbox = _INBOXES[event_loop] = LoopInbox(event_loop)
            return inbox

    def put(self, items: list[tuple[Receiver, Any]]) -> None:
        """Called by the engine thread: `items` for the loop's streams, in delivery order."""
        with self._lock:
            self._items += items
            if self._scheduled:
                return
            self._scheduled = True
        event_loop = self._loop()
        try:
            if event_loop is None:
                raise RuntimeError("event loop gone")
            event_loop.call_soon_threadsafe(self._dispatch)
        except RuntimeError:  # the readers' event loop is closed: nobody is listening
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _dispatch(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        by_stream: dict[Receiver, list] = {}
        for stream, item in items:
            got = by_stream.get(stream)
            if got is None:
                by_stream[stream] = [item]
            else:
                got.append(item)
        for stream, got in by_stream.items():
            stream._receive(got)

"""The supervisor's relay of the frontend's messages to its worker, and its picture of what is open.

The supervisor reads every message the frontend sends, cuts it whole (`InboundParser`) and hands
it to the worker over the worker's own socket pair. A request is open from the moment its message
is read here until the worker reports its final frame (`E`); `S` marks its first frame (the 200
status line). Because the supervisor reads first, its picture never misses a request the worker
has seen, however the worker dies. Messages the worker never received go to its replacement.
docs/reliability.md, "Worker death".

Standard library only, like the supervisor.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from dataclasses import dataclass

from orcaserve.handler.torchserve.frames import InboundParser

log = logging.getLogger(__name__)


@dataclass
class _Message:
    size: int  # bytes
    ids: list[str]


class Relay:
    """The bytes on their way to the worker and the requests open on the connection."""

    def __init__(self) -> None:
        self._parser = InboundParser()
        self.open: dict[str, bool] = {}  # request id -> its 200 status line went out
        self.stopping = False  # the worker stops on request (`Q`)
        self.exact = True  # False once a message could not be followed
        self._out = bytearray()  # bytes not yet handed to the worker: the queued messages' rest
        self._messages: deque[_Message] = deque()  # messages not yet wholly handed over
        self._head_sent = 0  # bytes of the first of them the current worker has taken

    # ---- the frontend's side -------------------------------------------------------------------
    def from_frontend(self, data: bytes) -> None:
        if not self.exact:
            self._out += data
            return
        try:
            messages = self._parser.feed(data)
        except ValueError:  # not an inference message: from now on nothing can be vouched for
            log.exception("orcaserve supervisor: cannot follow the frontend's messages; no takeover will be tried")
            self.exact = False
            self._out += self._parser.take()
            return
        for raw, ids in messages:
            for rid in ids:
                self.open[rid] = False
            self._out += raw
            self._messages.append(_Message(len(raw), ids))

    # ---- the worker's side ---------------------------------------------------------------------
    def backlog(self) -> int:
        """Bytes read from the frontend and not yet handed to a worker."""
        return len(self._out)

    def hand_over(self, inbound: socket.socket) -> None:
        """Hand what the worker's socket takes now (non-blocking; OSError once the worker is gone)."""
        n = inbound.send(self._out)
        del self._out[:n]
        self._head_sent += n
        while self._messages and self._messages[0].size <= self._head_sent:
            self._head_sent -= self._messages.popleft().size

    def event(self, line: bytes) -> None:
        op, _, rid = line.decode().partition(" ")
        if op == "S" and rid in self.open:
            self.open[rid] = True
        elif op == "E":
            self.open.pop(rid, None)
        elif op == "Q":
            self.stopping = True

    def worker_gone(self) -> dict[str, bool]:
        """The requests the dead worker may have seen and not finished (to be answered); the
        messages it never received stay queued for the next worker."""
        if self._head_sent:  # a message it had begun to read: its rest goes nowhere
            del self._out[: self._messages.popleft().size - self._head_sent]
            self._head_sent = 0
        unseen = {rid for m in self._messages for rid in m.ids}
        left = {rid: started for rid, started in self.open.items() if rid not in unseen}
        for rid in left:
            del self.open[rid]
        return left

    def unsent(self) -> dict[str, bool]:
        """Every request no worker has received, none started (answered when no worker will),
        emptying the queue."""
        ids = {rid: False for m in self._messages for rid in m.ids}
        for rid in ids:
            self.open.pop(rid, None)
        self._messages.clear()
        self._out.clear()
        self._head_sent = 0
        return ids

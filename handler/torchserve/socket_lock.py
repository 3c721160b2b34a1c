"""Whole-frame writes on the TorchServe worker socket, and an observer of what crosses it.

In async mode two threads write to the same socket: the asyncio thread sends intermediate
(streaming) frames from `send_intermediate_predict_response`, and `AsyncService.send_responses`
sends final frames. `socket.sendall` is not atomic: under back-pressure it loops over partial
`send()` calls and releases the GIL between them, so two frames can interleave byte-wise and the
frontend then reads garbage. Both writers call `cl_socket.sendall` on the same socket object, so
switching that object's class to one whose `sendall` holds a process-wide lock serialises every
frame without touching TorchServe's code.

The same class lets an observer (the supervisor's link, supervisor/link.py) see every frame the
worker writes, and takes the worker's reads from the supervisor's relay instead of the frontend's
connection once a supervisor runs: the supervisor reads each message first, so it knows exactly
which requests a dead worker left without an answer (docs/reliability.md, "Worker death").
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Protocol

_LOCK = threading.Lock()


class SocketObserver(Protocol):
    """Sees what the worker writes (the supervisor's link, supervisor/link.py)."""

    def writing(self, frame: bytes, intermediate: list[str] | None = None) -> None:
        """A frame about to be written (under the lock). `intermediate`: when the writer knows
        the frame holds intermediate predictions only, their request ids (no need to parse it)."""

    def written(self) -> None:
        """The frame reported by `writing` is entirely on the socket."""


_OBSERVER: SocketObserver | None = None
_INBOUND: socket.socket | None = None  # the supervisor's relay of the frontend's messages


def observe(observer: SocketObserver | None) -> None:
    global _OBSERVER
    _OBSERVER = observer


def observer() -> SocketObserver | None:
    return _OBSERVER


def relay(inbound: socket.socket | None) -> None:
    """Read the frontend's messages from `inbound` (the supervisor's relay) from now on."""
    global _INBOUND
    _INBOUND = inbound


class LockedSocket(socket.socket):
    """A socket whose `sendall` writes each buffer as one uninterrupted unit, and whose reads
    come from the supervisor's relay where one runs."""

    __slots__ = ()

    def sendall(self, data, flags: int = 0) -> None:
        self._write(data, flags, None)

    def sendall_intermediate(self, data: bytes, request_ids: list[str]) -> None:
        """`sendall` of a frame of intermediate predictions of `request_ids` (`send_intermediate`)."""
        self._write(data, 0, request_ids)

    def _write(self, data, flags: int, intermediate: list[str] | None) -> None:
        with _LOCK:
            obs = _OBSERVER
            if obs is None:
                super().sendall(data, flags)
                return
            obs.writing(bytes(data), intermediate)
            super().sendall(data, flags)
            obs.written()

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        inbound = _INBOUND
        return super().recv(bufsize, flags) if inbound is None else inbound.recv(bufsize, flags)


def send_intermediate(sock: Any, frame: bytes, request_ids: list[str]) -> None:
    """`sock.sendall(frame)` for a frame whose predictions are all intermediate, of `request_ids`
    in order: an observer takes the ids instead of parsing the frame (stream_frames.py writes one
    such frame a step)."""
    if isinstance(sock, LockedSocket):
        sock.sendall_intermediate(frame, request_ids)
    else:
        sock.sendall(frame)


def install(sock: object) -> bool:
    """Make `sock.sendall` frame-atomic in place; returns True if the socket is (now) locked.

    Idempotent. Objects that are not plain `socket.socket`s (e.g. test doubles) are left alone.
    """
    if isinstance(sock, LockedSocket):
        return True
    if type(sock) is not socket.socket:
        return False
    # Same memory layout (no new slots), so CPython allows the class swap on the live object.
    sock.__class__ = LockedSocket
    return True

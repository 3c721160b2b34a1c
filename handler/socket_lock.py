"""Whole-frame writes on the TorchServe worker socket.

In async mode two threads write to the same socket: the asyncio thread sends intermediate
(streaming) frames from `send_intermediate_predict_response`, and `AsyncService.send_responses`
sends final frames. `socket.sendall` is not atomic: under back-pressure it loops over partial
`send()` calls and releases the GIL between them, so two frames can interleave byte-wise and the
frontend then reads garbage. Both writers call `cl_socket.sendall` on the same socket object, so
switching that object's class to one whose `sendall` holds a process-wide lock serialises every
frame without touching TorchServe's code.
"""

from __future__ import annotations

import socket
import threading

_LOCK = threading.Lock()


class LockedSocket(socket.socket):
    """A socket whose `sendall` writes each buffer as one uninterrupted unit."""

    __slots__ = ()

    def sendall(self, data, flags: int = 0) -> None:  # type: ignore[override]
        with _LOCK:
            super().sendall(data, flags)


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

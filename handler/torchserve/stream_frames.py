"""Every stream's new text of one event-loop round in one predict-response frame.

A frame of TorchServe's backend protocol carries a list of predictions, each with its own request
id, content type, status, headers and body, and the frontend hands each to its own job (its own
HTTP chunk on its own connection). After an engine step one callback of the asyncio loop hands
every stream its outputs (`RequestStream.follow`); each shapes its Server-Sent Events and queues
them here, and the round ends with one frame and one `sendall` for all of them, instead of one
frame built by `create_predict_response` and written per stream (docs/benchmark-serving.md,
"Where the serving path spends its CPU"). What each client receives is unchanged: the same
bytes, as one chunk per step as before.

A stream's part before its body (id, content type, status, headers with `ts_stream_next: true`)
is encoded once, at its first chunk: TorchServe sends the status line and headers with the first
chunk, so nothing a handler sets afterwards would reach the client anyway.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from dataclasses import dataclass
from typing import Any

from orcaserve.handler.torchserve import socket_lock

log = logging.getLogger(__name__)

_HEAD = struct.pack("!i", 200) + struct.pack("!i", 31) + b"Intermediate Prediction success"
_END = struct.pack("!i", -1)
_INT = struct.Struct("!i")


def _s(data: bytes) -> bytes:
    return _INT.pack(len(data)) + data


@dataclass(frozen=True)
class PredictionHead:
    """A streamed request's prediction up to its body (`data`), and the request's id."""

    request_id: str
    data: bytes


def prediction_head(context: Any) -> PredictionHead:
    """A streamed request's prediction up to its body, as `create_predict_response` encodes it
    for an intermediate chunk (it sets `ts_stream_next: true` on the context, as that does)."""
    context.set_response_header(0, "ts_stream_next", "true")
    code, phrase = context.get_response_status(0)
    headers = context.get_response_headers(0)
    out = _s(context.request_ids[0].encode()) + _s((context.get_response_content_type(0) or "").encode())
    out += _INT.pack(200 if code is None else code) + _s((phrase or "").encode())
    out += _INT.pack(len(headers)) + b"".join(_s(k.encode()) + _s(v.encode()) for k, v in headers.items())
    return PredictionHead(context.request_ids[0], out)


class StreamFrames:
    """Intermediate chunks queued during one round of the event loop, written as one frame when
    the round ends (or at once by `flush`: before a final frame, which another thread writes).
    A frame stays under `max_frame_bytes`, TorchServe's limit on what it reads; a larger round
    goes out as several frames."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._parts: list[bytes] = []
        self._ids: list[str] = []  # whose chunk each one is, for the socket's observer
        self._size = 0
        self._socket: Any = None
        self._scheduled = False

    def add(self, sock: Any, head: PredictionHead, body: bytes) -> None:
        """Queue one chunk: `head` from `prediction_head`, `body` at most a frame's worth."""
        if self._socket is not None and sock is not self._socket:
            self.flush()  # another socket (tests); a worker has one
        self._socket = sock
        size = len(head.data) + 4 + len(body)
        if self._parts and self._size + size > self.max_frame_bytes:
            self.flush()
        self._parts += (head.data, _INT.pack(len(body)), body)  # joined once, at the flush
        self._ids.append(head.request_id)
        self._size += size
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._end_of_round)

    def _end_of_round(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        """Write what is queued, as one frame."""
        if not self._parts:
            return
        parts, ids, self._parts, self._ids, self._size = self._parts, self._ids, [], [], 0
        socket_lock.send_intermediate(self._socket, b"".join((_HEAD, *parts, _END)), ids)

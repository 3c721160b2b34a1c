"""TorchServe's backend wire format (OTF), the few pieces the supervisor needs, stdlib only.

The frontend sends inference messages (b"I", then per request its id, headers and parameters,
each list ended by -1); the worker answers with predict-response frames (a message code and text,
then per request its id, content type, status, reason phrase, headers and body, ended by -1).
`ts.protocol.otf_message_handler` has the full codec, but importing it imports torch.
"""

from __future__ import annotations

import json
import struct

WORKER_GONE = {
    "message": "the model worker stopped unexpectedly; retry the request",
    "type": "server_error",
    "param": None,
    "code": None,
}


def _s(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def response_frame(request_id: str, body: bytes, status: int, content_type: str, headers: dict[str, str]) -> bytes:
    """One predict-response frame for one request."""
    phrase = b"" if status == 200 else b"Service Unavailable"
    out = struct.pack("!i", 200) + _s(b"Prediction success") + _s(request_id.encode())
    out += _s(content_type.encode()) + struct.pack("!i", status) + _s(phrase)
    out += struct.pack("!i", len(headers)) + b"".join(_s(k.encode()) + _s(v.encode()) for k, v in headers.items())
    return out + _s(body) + struct.pack("!i", -1)


def final_frames(request_id: str, started: bool, error: dict = WORKER_GONE) -> bytes:
    """What ends a request its worker can no longer answer: an in-band SSE error and [DONE] if
    its 200 status line went out, else a 503 JSON error. An error status travels as a complete
    frame, and a `ts_stream_next: false` frame then releases the job (see `reply.Reply`)."""
    if started:
        body = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
        return response_frame(request_id, body, 200, "text/event-stream", {"ts_stream_next": "false"})
    return response_frame(
        request_id, json.dumps({"error": error}).encode(), 503, "application/json", {"Retry-After": "5"}
    ) + response_frame(request_id, b"", 200, "", {"ts_stream_next": "false"})


def written_requests(frame: bytes) -> list[tuple[str, bool]]:
    """(request id, whether this frame releases it) for each prediction of a response frame."""
    out: list[tuple[str, bool]] = []
    pos = 4
    (n,) = struct.unpack_from("!i", frame, pos)
    pos += 4 + n  # message
    while True:
        (n,) = struct.unpack_from("!i", frame, pos)
        if n == -1:
            return out
        rid = frame[pos + 4 : pos + 4 + n].decode()
        pos += 4 + n
        (n,) = struct.unpack_from("!i", frame, pos)
        pos += 4 + n + 4  # content type, status
        (n,) = struct.unpack_from("!i", frame, pos)
        pos += 4 + n  # reason phrase
        (count,) = struct.unpack_from("!i", frame, pos)
        pos += 4
        final = False
        for _ in range(count):
            (n,) = struct.unpack_from("!i", frame, pos)
            key = frame[pos + 4 : pos + 4 + n]
            pos += 4 + n
            (n,) = struct.unpack_from("!i", frame, pos)
            final |= key == b"ts_stream_next" and frame[pos + 4 : pos + 4 + n] == b"false"
            pos += 4 + n
        (n,) = struct.unpack_from("!i", frame, pos)
        pos += 4 + max(n, 0)  # body
        out.append((rid, final))


def parse_inference(buf: bytes | bytearray) -> tuple[int, list[str]] | None:
    """(bytes consumed, request ids) of the inference message at the start of `buf`, or None
    while it is incomplete; ValueError if it is not an inference message."""
    if not buf:
        return None
    if buf[:1] != b"I":
        raise ValueError(f"not an inference message: {bytes(buf[:1])!r}")
    pos, ids = 1, []

    def length() -> int:
        nonlocal pos
        if pos + 4 > len(buf):
            raise IndexError
        (n,) = struct.unpack_from("!i", buf, pos)
        pos += 4
        return n

    def skip(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(buf):
            raise IndexError
        pos += n
        return bytes(buf[pos - n : pos])

    try:
        while (n := length()) != -1:
            ids.append(skip(n).decode())
            while (n := length()) != -1:  # headers: name, value
                skip(n)
                skip(length())
            while (n := length()) != -1:  # parameters: name, content type, value
                skip(n)
                skip(length())
                skip(length())
    except IndexError:
        return None
    return pos, ids


class InboundParser:
    """Cuts the frontend's byte stream into whole inference messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, list[str]]]:
        """(the message's bytes, its request ids) for each message `data` completes; ValueError on
        a message that is not an inference message."""
        self._buf += data
        out: list[tuple[bytes, list[str]]] = []
        while (parsed := parse_inference(self._buf)) is not None:
            used, ids = parsed
            out.append((bytes(self._buf[:used]), ids))
            del self._buf[:used]
        return out

    def take(self) -> bytes:
        """What is buffered (a message's beginning), emptying the parser."""
        rest, self._buf = bytes(self._buf), bytearray()
        return rest

"""The frames of one request's HTTP response in TorchServe's async mode."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from orcaserve.handler.openai.errors import HttpError
from orcaserve.handler.openai.protocol import HTTP_PHRASES
from orcaserve.handler.openai.responses import SSE_DONE, sse
from orcaserve.handler.torchserve.stream_frames import PredictionHead, StreamFrames, prediction_head


class Reply:
    """Writes one request's response frames.

    TorchServe's frontend (RestJob) writes the status line and headers with the first frame that
    carries `ts_stream_next: true`, and only a frame with `ts_stream_next: false` releases the job;
    a lone `false` frame would be written as a body chunk without any status line. So a 200
    response is at least one `true` frame followed by exactly one `false` frame. An error status
    cannot go that way (the frontend closes the connection right after an error status line, before
    the body chunk), so errors are one complete frame without the header, then the `false` frame
    that releases the job (its empty body lands on the closed connection and is dropped).

    The frontend's decoder refuses a frame above its `max_response_size` (seen: such a request is
    never answered, the client waits out its own timeout): a body longer than `max_frame_bytes` (a
    non-streamed answer with log-probabilities runs to megabytes) goes out as several frames, which
    the client receives as chunks of one body.

    With `frames`, streamed chunks join the other streams' of the same event-loop round in one
    frame (`stream_frames.py`); what is queued there goes out before this request's final frame.
    """

    def __init__(self, context: Any, max_frame_bytes: int, frames: StreamFrames | None = None) -> None:
        self.context = context
        self.started = False  # a frame went out
        self.opened = False  # a streamed 200 is chosen: errors go in-band from now on
        self.max_frame_bytes = max_frame_bytes
        self._in_band: Callable[[HttpError], str] | None = None
        # Only rank 0 answers (as `send_intermediate_predict_response` checks).
        self._frames = frames if os.getenv("LOCAL_RANK", "0") == "0" else None
        self._head: PredictionHead | None = None  # this stream's prediction before its body (stream_frames.py)

    def open(self, content_type: str, in_band: Callable[[HttpError], str] | None = None) -> None:
        """Choose a streamed 200 answer of `content_type`; its first frame goes out with `send`.
        `in_band`: an error as the stream's protocol tells it once the 200 is out (default:
        OpenAI's, an error object then `[DONE]`)."""
        self.context.set_response_content_type(0, content_type)
        self.opened = True
        self._in_band = in_band

    def send(self, text: str) -> None:
        """Intermediate frames (written now, from the asyncio thread), each at most
        `max_frame_bytes` of the body; with `frames`, queued for the round's frame."""
        data = text.encode()
        self.started = True
        if self._frames is not None:
            if self._head is None:
                self._head = prediction_head(self.context)
            sock = self.context.cl_socket
            if len(data) <= self.max_frame_bytes:  # a token's chunk
                self._frames.add(sock, self._head, data)
                return
            for start in range(0, len(data), self.max_frame_bytes):
                self._frames.add(sock, self._head, data[start : start + self.max_frame_bytes])
            return
        from ts.handler_utils.utils import send_intermediate_predict_response

        for start in range(0, max(len(data), 1), self.max_frame_bytes):
            send_intermediate_predict_response(
                [data[start : start + self.max_frame_bytes]],
                self.context.request_ids,
                "Intermediate Prediction success",
                200,
                self.context,
            )

    def send_complete(self, text: str) -> None:
        """A complete (non-chunked) response: status, headers and body in one frame."""
        from ts.protocol.otf_message_handler import create_predict_response

        frame = create_predict_response([text], self.context.request_ids, "Prediction error", 200, self.context)
        self.flush()
        self.context.cl_socket.sendall(frame)
        self.started = True

    def fail(self, error: HttpError) -> str:
        """Answer with an error (`openai/errors.py`); returns the final frame's body.

        Before a stream opened this is a real HTTP status with the error's body (in its protocol's
        shape: handler/protocols.py); once its 200 is chosen the error can only travel in-band, as
        the stream's protocol tells it (`open`'s `in_band`)."""
        if self.started or self.opened:
            return self._in_band(error) if self._in_band is not None else sse(error.body) + SSE_DONE
        self.context.set_response_status(error.status, HTTP_PHRASES.get(error.status, ""), 0)
        self.context.set_response_content_type(0, "application/json")
        if error.retry_after is not None:
            self.context.set_response_header(0, "Retry-After", str(error.retry_after))
        self.send_complete(json.dumps(error.body))
        return ""

    def finish(self, text: str) -> str:
        """The final frame's body; TorchServe sends it after `handle` returns."""
        if not self.started or len(text) > self.max_frame_bytes // 4:  # 4: UTF-8's longest character
            self.send(text)
            text = ""
        self.context.set_response_header(0, "ts_stream_next", "false")
        self.flush()  # the final frame goes out from another thread once `handle` returns
        return text

    def flush(self) -> None:
        """Write the chunks queued for this round now (`stream_frames.py`)."""
        if self._frames is not None:
            self._frames.flush()

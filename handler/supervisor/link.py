"""The worker's side of the supervisor (process.py): starting it beside a worker TorchServe
started, and the link through which the worker reads the frontend's messages and reports the
frames it writes.

Standard library only, like the supervisor, which imports its constants from here.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import subprocess
import sys
from types import FrameType
from typing import Any

from orcaserve.handler.torchserve import socket_lock
from orcaserve.handler.torchserve.frames import written_requests

log = logging.getLogger(__name__)

ENV = "ORCASERVE_SUPERVISED"  # "EVENTS_FD,FLAG_FD,INBOUND_FD" in a replacement worker's environment
FLAG_BYTES = 1


class SupervisorLink:
    """The worker's end: reads the frontend's messages from the supervisor, tells it what it writes.

    The supervisor reads every message the frontend sends and hands it on over `inbound` (a socket
    pair; `socket_lock.relay` makes the worker's reads come from there), so it knows each request
    the worker may have seen before the worker sees it. The worker reports on a pipe what it
    writes (`socket_lock.observe`): `S id` before a request's first frame (the 200 status line),
    `E id` before its final frame, `Q` when it stops on request. A shared flag covers each frame
    written, so after a death the supervisor knows whether the connection is between frames.
    Event writes are single `os.write` calls under PIPE_BUF bytes (atomic); if the supervisor is
    gone or its pipe is full, reporting stops rather than block.
    """

    def __init__(
        self, events_fd: int, flag: mmap.mmap, inbound: socket.socket, proc: subprocess.Popen | None = None
    ) -> None:
        self._fd = events_fd
        os.set_blocking(self._fd, False)
        self.flag = flag  # [0]: a frame is being written
        self.inbound = inbound
        self._proc = proc
        self._ok = True
        self._started: set[str] = set()  # requests with a frame on the socket, not yet final

    @classmethod
    def start(cls, sock: socket.socket, load: dict, metrics_config: str) -> SupervisorLink:
        """Start the supervisor beside this worker (the one TorchServe started), while the socket
        is between messages. `load`: how a replacement loads the model, as TorchServe's LOAD did."""
        read_fd, write_fd = os.pipe()
        flag_fd = new_flag_fd()
        inbound, theirs = socket.socketpair()
        fds = (sock.fileno(), read_fd, flag_fd, theirs.fileno())
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orcaserve.handler.supervisor.process",
                "--sock-fd",
                str(fds[0]),
                "--events-fd",
                str(read_fd),
                "--flag-fd",
                str(flag_fd),
                "--inbound-fd",
                str(fds[3]),
                "--worker-pid",
                str(os.getpid()),
                "--load",
                json.dumps(load),
                "--metrics-config",
                metrics_config,
            ],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
        )
        os.close(read_fd)
        theirs.close()
        flag = mmap.mmap(flag_fd, FLAG_BYTES)
        os.close(flag_fd)
        log.info("orcaserve: supervisor %d watches worker %d", proc.pid, os.getpid())
        return cls(write_fd, flag, inbound, proc)

    @classmethod
    def attach(cls, spec: str) -> SupervisorLink:
        """In a replacement worker: the pipe, flag and relay its supervisor passed (`ENV`)."""
        events_fd, flag_fd, inbound_fd = (int(x) for x in spec.split(","))
        flag = mmap.mmap(flag_fd, FLAG_BYTES)
        os.close(flag_fd)
        return cls(events_fd, flag, socket.socket(fileno=inbound_fd))

    def _send(self, event: str) -> None:
        if not self._ok:
            return
        try:
            os.write(self._fd, f"{event}\n".encode())
        except OSError as e:
            self._ok = False
            log.error("orcaserve: supervisor unreachable (%s); a dead worker's requests will not be answered", e)

    def writing(self, frame: bytes, intermediate: list[str] | None = None) -> None:
        self.flag[0] = 1
        if intermediate is not None:  # the writer knows them: no final among them
            updates = [(rid, False) for rid in intermediate]
        else:
            try:
                updates = written_requests(frame)
            except Exception:  # not a predict frame: nothing to report
                return
        for rid, final in updates:
            if final:
                self._started.discard(rid)
                self._send(f"E {rid}")
            elif rid not in self._started:
                self._started.add(rid)
                self._send(f"S {rid}")

    def written(self) -> None:
        self.flag[0] = 0

    def stopping(self) -> None:
        """This worker stops on request (SIGTERM): do not replace it."""
        self._send("Q")

    def attach_to_socket(self) -> None:
        """From now on the worker's reads come from the relay and its frames are reported."""
        socket_lock.relay(self.inbound)
        socket_lock.observe(self)


def new_flag_fd() -> int:
    fd = os.memfd_create("orcaserve-socket-flags")
    os.ftruncate(fd, FLAG_BYTES)
    return fd


def start_supervisor(context: Any, props: dict) -> SupervisorLink | None:
    """Lock the connection to the frontend, start the supervisor beside it and read through it.

    The connection is not handed to handlers: during `initialize` it is the `cl_socket` local of
    TorchServe's `handle_connection_async`, up the stack (ts 0.12). Found there, it is between
    messages (the LOAD is read, no request yet), so the relay starts at a message boundary."""
    frame: FrameType | None = sys._getframe()
    while frame is not None and not isinstance(frame.f_locals.get("cl_socket"), socket.socket):
        frame = frame.f_back
    if frame is None:
        log.warning("orcaserve: no TorchServe connection found; a dead worker's requests will not be answered")
        return None
    sock = frame.f_locals["cl_socket"]
    try:
        socket_lock.install(sock)
        link = SupervisorLink.start(sock, _load_spec(context, props), _metrics_config())
    except Exception:
        log.exception("orcaserve: could not start the supervisor; a dead worker's requests will not be answered")
        return None
    link.attach_to_socket()
    return link


def _load_spec(context: Any, props: dict) -> dict:
    """What TorchServe's LOAD message said, so that a replacement worker loads the same way."""
    manifest = getattr(context, "manifest", None) or {}
    return {
        "model_name": getattr(context, "model_name", None),
        "model_dir": props.get("model_dir"),
        "batch_size": props.get("batch_size") or 1,
        "handler": (manifest.get("model") or {}).get("handler"),
        "gpu": props.get("gpu_id"),
        "limit_max_image_pixels": props.get("limit_max_image_pixels", True),
    }


def _metrics_config() -> str:
    """The metrics config TorchServe gave this worker (`--metrics-config`), for a replacement."""
    argv = sys.argv
    if "--metrics-config" in argv[:-1]:
        return argv[argv.index("--metrics-config") + 1]
    import ts

    return os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml")

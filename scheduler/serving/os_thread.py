"""The calling thread's name in the OS, so `top -H`, `ps -L` and /proc/<pid>/task/*/comm tell the
engine's threads apart (Python's own thread names stay inside Python). Linux only; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Set the calling thread's OS name (the kernel keeps 15 bytes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl to be found: the name is cosmetic
        pass


def name_spawned_threads(name: str) -> int:
    """Rename this process's other threads that still carry the calling thread's OS name (threads
    it started, an OpenMP runtime's workers among them: Linux hands a new thread its creator's
    name) to `name`; returns how many. So a profile of `orca-engine` is the loop's own work, and
    its OpenMP workers show apart (docs/one-stream.md "Over HTTP: who else needs a core")."""
    if not sys.platform.startswith("linux"):
        return 0
    own = threading.get_native_id()
    tasks = f"/proc/{os.getpid()}/task"
    try:
        mine = _read(f"{tasks}/{own}/comm")
        renamed = 0
        for tid in os.listdir(tasks):
            if int(tid) != own and _read(f"{tasks}/{tid}/comm") == mine:
                with open(f"{tasks}/{tid}/comm", "w") as f:
                    f.write(name[:15])
                renamed += 1
        return renamed
    except OSError:  # a thread gone meanwhile, or no /proc: the names are cosmetic
        return 0


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library this process already has loaded: no lookup, no subprocess

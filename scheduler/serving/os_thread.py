"""The calling thread's name in the OS, so `top -H`, `ps -L` and /proc/<pid>/task/*/comm tell the
engine's threads apart (Python's own thread names stay inside Python). Linux only; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import functools
import sys

_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Set the calling thread's OS name (the kernel keeps 15 bytes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl to be found: the name is cosmetic
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library this process already has loaded: no lookup, no subprocess

"""The engine's neighbours on the cores, one step lower in CPU priority: TorchServe's Java frontend
(the worker's parent process) and the worker's own threads other than the engine's.

On a host with as many cores as the engine has compute threads, every other thread that wakes
takes a core from one of them, and the other waits for it at the next OpenMP barrier. A higher
niceness makes the scheduler run those neighbours in fewer, later slices instead of on every
wake-up (docs/serving.md, "The engine's neighbours"). Lowering a thread's priority needs no
privilege; a thread that refuses (another user's) is left alone. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# The engine loop's thread and its OpenMP workers (named by scheduler/serving/os_thread.py; a
# worker started before its renaming carries its creator's name, the loop's).
ENGINE_THREADS = frozenset({"orca-engine", "orca-omp"})
FRONTEND = "java"


def lower_neighbours(nice: int) -> int:
    """Give niceness `nice` to every thread of this process that is not the engine's and to every
    thread of the parent process if it is the Java frontend; returns how many took it. Threads
    those create later inherit it (Linux gives a new thread its creator's niceness)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return 0
    lowered = _lower(os.getpid(), nice, skip=ENGINE_THREADS)
    parent = os.getppid()
    if _comm(f"/proc/{parent}/comm") == FRONTEND:
        lowered += _lower(parent, nice, skip=frozenset())
    log.info("orcaserve: %d threads beside the engine at nice %d", lowered, nice)
    return lowered


def _lower(pid: int, nice: int, skip: frozenset[str]) -> int:
    lowered = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        name = _comm(f"/proc/{pid}/task/{tid}/comm")
        if name is None or name in skip:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:  # never raise one set lower already
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)  # on Linux, that thread alone
                lowered += 1
        except OSError:  # gone meanwhile, or not ours to change
            pass
    return lowered


def _comm(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None

"""Thread names in the OS: the engine loop's spawned threads (its OpenMP workers) named apart."""

import sys
import threading
from pathlib import Path

import pytest

from orcaserve.scheduler.serving.os_thread import name_spawned_threads, name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc thread names")


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_spawned_threads_take_their_own_name():
    """A thread started by a named thread inherits its name (Linux); `name_spawned_threads` gives
    those threads the new name and leaves the caller and every other thread alone."""
    release, child_tid, result = threading.Event(), [], {}

    def child() -> None:
        child_tid.append(threading.get_native_id())
        release.wait(30)

    def parent() -> None:
        name_this_thread("orca-test-loop")
        t = threading.Thread(target=child)
        t.start()
        while not child_tid:
            pass
        result["renamed"] = name_spawned_threads("orca-test-omp")
        result["own"] = _comm(threading.get_native_id())
        result["child"] = _comm(child_tid[0])
        release.set()
        t.join()

    before = _comm(threading.get_native_id())
    p = threading.Thread(target=parent)
    p.start()
    p.join()
    assert result == {"renamed": 1, "own": "orca-test-loop", "child": "orca-test-omp"}
    assert _comm(threading.get_native_id()) == before

"""The engine's neighbours one step lower in CPU priority (handler/neighbours.py): every thread of
the worker but the engine's, and none of a parent that is not TorchServe's Java frontend."""

import json
import os
import subprocess
import sys

import pytest

from orcaserve.handler.config import HandlerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")

# In a child process: lowering priority cannot be undone without privileges.
_CHILD = """
import json, os, threading
from orcaserve.handler.neighbours import lower_neighbours
from orcaserve.scheduler.serving.os_thread import name_this_thread
ready, done, tids = threading.Barrier(3), threading.Event(), {}
def run(name):
    if name:
        name_this_thread(name)
    tids[name or "other"] = threading.get_native_id()
    ready.wait()
    done.wait(30)
threads = [threading.Thread(target=run, args=(n,)) for n in ("orca-engine", "")]
for t in threads:
    t.start()
ready.wait()
lowered = lower_neighbours(NICE)
tids["main"] = threading.get_native_id()
nice = {k: os.getpriority(os.PRIO_PROCESS, tid) for k, tid in tids.items()}
done.set()
for t in threads:
    t.join()
print(json.dumps({"lowered": lowered, "nice": nice, "parent": os.getpriority(os.PRIO_PROCESS, os.getppid())}))
"""


def _child(nice: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.replace("NICE", str(nice))], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_every_thread_but_the_engines_lowered_and_a_non_java_parent_left_alone():
    got = _child(7)
    assert got["nice"] == {"orca-engine": 0, "other": 7, "main": 7}
    assert got["lowered"] >= 2  # and any thread an import started
    assert got["parent"] == os.getpriority(os.PRIO_PROCESS, os.getpid())


def test_zero_changes_nothing():
    got = _child(0)
    assert got["lowered"] == 0 and set(got["nice"].values()) == {0}


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "10"])
def test_neighbour_nice_validated(bad):
    with pytest.raises(ValueError, match="neighbour_nice"):
        HandlerConfig.from_dict({"neighbour_nice": bad})


def test_neighbour_nice_read():
    assert HandlerConfig.from_dict({}).neighbour_nice == 0
    assert HandlerConfig.from_dict({"neighbour_nice": 10}).neighbour_nice == 10

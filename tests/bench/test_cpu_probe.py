"""The serving path's CPU breakdown: a server's session read from /proc, by process and thread."""

import subprocess
import sys
import time

from orcaserve.bench.serve.cpu_probe import CpuProbe, table

# A "server" of its own session whose named thread spins for a while, then sleeps until killed.
SERVER = """
import threading, time
from orcaserve.scheduler.serving.os_thread import name_this_thread
def spin():
    name_this_thread("orca-engine")
    end = time.thread_time() + 0.6
    while time.thread_time() < end:
        pass
    time.sleep(60)
threading.Thread(target=spin, daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def test_cpu_of_a_session_by_thread_name():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, start_new_session=True)
    try:
        probe = CpuProbe(proc.pid)
        before = probe.snapshot()
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        time.sleep(0.1)
        deadline = time.monotonic() + 60  # a loaded machine may take a while to give it 0.6 s
        while True:
            after = probe.snapshot()
            if sum(v for k, v in after.items() if k[2] == "orca-engine") >= 0.55:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cpu = CpuProbe.delta(before, after, output_tokens=100, wall_s=2.0)
    finally:
        proc.kill()
        proc.wait()
    [engine] = [r for r in cpu["threads"] if r["thread"] == "orca-engine"]
    assert engine["role"] == "server" and engine["process"].startswith("python") and 0.55 <= engine["cpu_s"] < 1.5
    assert engine["ms_per_token"] == round(1e3 * engine["cpu_s"] / 100, 4)
    assert cpu["totals_s"]["server"] >= engine["cpu_s"]
    assert f"| server | {engine['process']} | orca-engine |" in table(cpu)


def test_a_few_milliseconds_of_cpu_are_counted():
    """A thread that ran 3 ms shows (stat's ticks are 10 ms: it would often read 0 there)."""
    probe = CpuProbe(None)
    before = probe.snapshot()
    end = time.thread_time() + 0.003
    while time.thread_time() < end:
        pass
    cpu = CpuProbe.delta(before, probe.snapshot(), output_tokens=1, wall_s=1.0)
    assert cpu["totals_s"]["client"] >= 0.002

"""The serving path's CPU breakdown: a server's session read from /proc, by process and thread."""

import subprocess
import sys
import threading
import time
from pathlib import Path

from orcaserve.bench.serve import run_delay
from orcaserve.bench.serve.cpu_probe import CpuProbe, read_task, table

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
            if sum(v.cpu_s for k, v in after.items() if k[2] == "orca-engine") >= 0.55:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cpu = CpuProbe.delta(before, after, output_tokens=100, wall_s=2.0)
    finally:
        proc.kill()
        proc.wait()
    [engine] = [r for r in cpu["threads"] if r["thread"] == "orca-engine"]
    assert engine["role"] == "server" and engine["process"].startswith("python") and 0.55 <= engine["cpu_s"] < 1.5
    assert abs(engine["ms_per_token"] - 1e3 * engine["cpu_s"] / 100) < 0.01  # cpu_s is rounded to 1 ms
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


def test_schedstat_and_switches_of_this_process_threads():
    """read_task parses the real /proc files of a thread of this test: its CPU and run delay as
    schedstat's first two fields say, its context switches as status says."""
    tid: list[int] = []
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        tid.append(threading.get_native_id())
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        time.sleep(0.01)  # one voluntary switch at least
        spun.set()
        done.wait()

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spun.wait(60)
        task = Path(f"/proc/self/task/{tid[0]}")
        got = read_task(task)
        cpu_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
        status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
    finally:
        done.set()
        t.join()
    assert got.cpu_s >= 0.045 and abs(got.cpu_s - cpu_ns * 1e-9) < 0.05  # it may run a little between reads
    assert 0 <= got.wait_s <= wait_ns * 1e-9 + 1e-9
    assert got.vcsw >= 1 and got.vcsw <= int(status["voluntary_ctxt_switches"])
    assert 0 <= got.nvcsw <= int(status["nonvoluntary_ctxt_switches"])
    before = CpuProbe(None).snapshot()
    assert all(v.wait_s >= 0 and v.nvcsw >= 0 for v in before.values())


def test_amplification_is_step_excess_over_extra_run_delay():
    def cpu(wall_s: float, waits: tuple[float, float]) -> dict:
        rows = [
            {"role": "server", "process": "p", "thread": t, "ms_per_token": 2.0, "wait_ms_per_token": w}
            for t, w in zip(run_delay.COMPUTE, waits, strict=True)
        ]
        rows.append({"role": "server", "process": "java", "thread": "epoll", "ms_per_token": 0.1})
        return {"output_tokens": 1000, "wall_s": wall_s, "threads": rows}

    http = run_delay.summary(cpu(3.0, (0.2, 0.1)), steps=40)  # 75 ms a step, 0.3 ms waited a token
    loop = run_delay.summary(cpu(2.6, (0.05, 0.05)), steps=40)  # 65 ms a step, 0.1 ms
    engine = run_delay.summary(cpu(2.5, (0.0, 0.0)), steps=40)
    assert http["neighbours_cpu_ms_per_token"] == 0.1 and http["step_ms"] == 75.0
    v = run_delay.against(http, loop, engine)
    assert abs(v["step_excess_ms_per_token"] - 0.4) < 1e-9 and abs(v["extra_wait_ms_per_token"] - 0.2) < 1e-9
    assert abs(v["amplification"] - 2.0) < 1e-9
    assert v["extra_cpu_ms_per_token"] == 0.0  # 2 ms a thread on both sides
    # 0.9x of the engine's 2.5 ms a token is 2.778 ms: 0.222 ms of wall to cut, 0.111 of run delay at 2x
    assert abs(v["wall_ms_per_token_to_cut"] - (3.0 - 2.5 / 0.9)) < 1e-9
    assert abs(v["wait_ms_per_token_to_cut"] - (3.0 - 2.5 / 0.9) / 2) < 1e-9
    assert "amplification 2.00 (4.00 over one thread's)" in run_delay.lines(http, v)
    # the machine's load eased between the runs: both differences negative, the same ratio
    assert abs(run_delay.against(loop, http)["amplification"] - 2.0) < 1e-9


def test_threads_that_ended_during_the_load_are_counted():
    """The load generator's client threads end before the last snapshot: their CPU still shows."""
    probe = CpuProbe(None)
    before = probe.snapshot()

    def spin() -> None:
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    deadline = time.monotonic() + 10  # join() returns a moment before the OS thread is gone
    while Path(f"/proc/self/task/{t.native_id}").exists():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    cpu = CpuProbe.delta(before, probe.snapshot(), output_tokens=1, wall_s=1.0)
    [ended] = [r for r in cpu["threads"] if r["thread"] == "(ended threads)"]
    assert 0.025 <= ended["cpu_s"] < 0.5

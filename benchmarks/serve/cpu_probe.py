"""CPU time, run-queue wait and preemptions of a server's processes and threads across a measured
load (Linux /proc).

A server started in its own session (TorchServe's launcher, its Java frontend and its Python
workers; vLLM's API server and its engine core) is every process whose session id is the launcher's
pid. `CpuProbe(sid)` reads, for each thread of each such process, from `schedstat` the time it has
run on a CPU (field 1, ns) and the time it sat runnable in a run queue without a CPU (field 2, the
run delay, ns), and from `status` its voluntary and nonvoluntary context switches (a thread that
blocked, one that was preempted). Where a kernel lacks `schedstat` the CPU time is stat's user +
system ticks (10 ms each: a thread that ran a few milliseconds would read 0) and the run delay 0.
Two snapshots around a load give what each part of the serving path spent on it and how long each
waited for a core. Threads are grouped by (process name, thread name) with digits folded, so the
frontend's `epollEventLoopGroup-3-1` and `-3-2` add up as one row. The load generator's own process
is counted apart (`client`): on a 2-vCPU machine it competes with the server for the same cores.
How to read the rows: docs/benchmark-serving.md, "Where the serving path spends its CPU", and
docs/serving.md, "The engine's CPU over HTTP" (the run delay of the engine's compute threads).
"""

from __future__ import annotations

import os
import re
import resource
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Sched:
    """One thread's (or one row's summed) scheduler counts since it started."""

    cpu_s: float  # on a CPU
    wait_s: float  # runnable in a run queue, not on a CPU (schedstat's run delay)
    nvcsw: int  # preempted (nonvoluntary context switches)
    vcsw: int  # blocked: a lock, a futex, I/O, a sleep (voluntary context switches)

    def __add__(self, o: Sched) -> Sched:
        return Sched(self.cpu_s + o.cpu_s, self.wait_s + o.wait_s, self.nvcsw + o.nvcsw, self.vcsw + o.vcsw)

    def __sub__(self, o: Sched) -> Sched:
        return Sched(self.cpu_s - o.cpu_s, self.wait_s - o.wait_s, self.nvcsw - o.nvcsw, self.vcsw - o.vcsw)


ZERO = Sched(0.0, 0.0, 0, 0)
Snapshot = dict[tuple[str, str, str], Sched]  # (role, process name, thread name) -> counts


def _stat(path: Path) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a /proc stat file; None once the task is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    head, _, tail = text.rpartition(")")
    return head.partition("(")[2], tail.split()


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(entry / "stat")) and int(st[1][3]) == sid:
            pids.append(int(entry.name))  # fields after comm: state ppid pgrp session ...
    return pids


def _threads(pid: int, role: str, into: Snapshot) -> None:
    proc = _stat(Path(f"/proc/{pid}/stat"))
    if proc is None:
        return
    pname = _DIGITS.sub("#", proc[0])
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if (st := _stat(task / "stat")) is None:
            continue
        key = (role, pname, _DIGITS.sub("#", st[0]))
        into[key] = into.get(key, ZERO) + read_task(task, st[1])


def read_task(task: Path, stat_fields: list[str] | None = None) -> Sched:
    """A task's counts: schedstat's CPU ns and run delay ns, status's context switches. Without
    schedstat, stat's user + system ticks (`stat_fields`: the fields after comm) and no delay."""
    try:
        cpu_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
        cpu, wait = cpu_ns * 1e-9, wait_ns * 1e-9
    except (OSError, ValueError):
        fields = stat_fields if stat_fields is not None else (_stat(task / "stat") or ("", []))[1]
        cpu = (int(fields[11]) + int(fields[12])) * TICK_S if len(fields) > 12 else 0.0  # utime, stime
        wait = 0.0
    switches = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    try:
        for line in (task / "status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in switches:
                switches[name] = int(value)
    except (OSError, ValueError):
        pass
    return Sched(cpu, wait, switches["nonvoluntary_ctxt_switches"], switches["voluntary_ctxt_switches"])


class CpuProbe:
    """Snapshots of the scheduler counts of a session's threads (role "server") and of this
    process's own threads (role "client")."""

    def __init__(self, sid: int | None) -> None:
        self.sid = sid

    def snapshot(self) -> Snapshot:
        out: Snapshot = defaultdict(lambda: ZERO)
        if self.sid is not None:
            for pid in _session_pids(self.sid):
                _threads(pid, "server", out)
        _threads(os.getpid(), "client", out)
        # The load generator's client threads end before the load's last snapshot: what this
        # process spent beyond its live threads (getrusage counts the ended ones too) is theirs.
        used = resource.getrusage(resource.RUSAGE_SELF)
        live = sum(v.cpu_s for k, v in out.items() if k[0] == "client")
        ended = max(0.0, used.ru_utime + used.ru_stime - live)
        pname = _DIGITS.sub("#", Path("/proc/self/comm").read_text().strip())
        out[("client", pname, "(ended threads)")] = Sched(ended, 0.0, 0, 0)
        return out

    @staticmethod
    def delta(before: Snapshot, after: Snapshot, output_tokens: int, wall_s: float) -> dict:
        """Rows of what each thread group spent between two snapshots (most CPU first): CPU
        seconds, with its ms per output token and its share of one core over the wall time; the
        run delay in ms per output token; preemptions and blocks per output token. Totals per role."""
        rows: list[dict[str, Any]] = []
        n = max(output_tokens, 1)
        for key, end in after.items():
            d = end - before.get(key, ZERO)  # a thread born during the load started at 0
            if d.cpu_s > 0 or d.wait_s > 0:
                role, process, thread = key
                rows.append(
                    {
                        "role": role,
                        "process": process,
                        "thread": thread,
                        "cpu_s": round(d.cpu_s, 3),
                        "ms_per_token": round(1e3 * d.cpu_s / n, 4),
                        "cores": round(d.cpu_s / max(wall_s, 1e-9), 3),
                        "wait_s": round(d.wait_s, 4),
                        "wait_ms_per_token": round(1e3 * d.wait_s / n, 4),
                        "preempted_per_token": round(d.nvcsw / n, 3),
                        "blocked_per_token": round(d.vcsw / n, 3),
                    }
                )
        rows.sort(key=lambda r: -r["cpu_s"])
        totals = {role: round(sum(r["cpu_s"] for r in rows if r["role"] == role), 3) for role in ("server", "client")}
        return {"wall_s": round(wall_s, 3), "output_tokens": output_tokens, "totals_s": totals, "threads": rows}


def table(cpu: dict, top: int = 12) -> str:
    """The breakdown as a markdown table (the `top` rows with most CPU)."""
    lines = [
        f"CPU over the measured load: {cpu['wall_s']} s wall, {cpu['output_tokens']} output tokens; "
        f"server {cpu['totals_s']['server']} s, client {cpu['totals_s']['client']} s",
        "",
        "| role | process | thread | CPU s | ms / token | cores | run delay ms / token | preempted / token |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in cpu["threads"][:top]:
        lines.append(
            f"| {r['role']} | {r['process']} | {r['thread']} | {r['cpu_s']} | {r['ms_per_token']} | {r['cores']} |"
            f" {r.get('wait_ms_per_token', '-')} | {r.get('preempted_per_token', '-')} |"
        )
    return "\n".join(lines)

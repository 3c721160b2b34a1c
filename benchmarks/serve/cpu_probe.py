"""CPU time of a server's processes and threads across a measured load (Linux /proc).

A server started in its own session (TorchServe's launcher, its Java frontend and its Python
workers; vLLM's API server and its engine core) is every process whose session id is the launcher's
pid. `CpuProbe(sid)` reads, for each thread of each such process, the time it has run on a CPU (the
scheduler's nanosecond count in `schedstat`; the user + system ticks of `stat`, 10 ms each, where a
kernel lacks it: a thread that ran a few milliseconds would read 0); two snapshots around a load
give what each part of the serving path spent on it. Threads are grouped by (process name, thread
name) with digits folded, so the frontend's `epollEventLoopGroup-3-1` and `-3-2` add up as one row.
The load generator's own process is counted apart (`client`): on a 2-vCPU machine it competes with
the server for the same cores. How to read the rows: docs/benchmark-serving.md, "Where the serving
path spends its CPU".
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_DIGITS = re.compile(r"\d+")

Snapshot = dict[tuple[str, str, str], float]  # (role, process name, thread name) -> CPU seconds


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
        into[(role, pname, _DIGITS.sub("#", st[0]))] += _cpu_s(task, st[1])


def _cpu_s(task: Path, fields: list[str]) -> float:
    """CPU seconds a task has run: schedstat's first field (ns on a CPU), else stat's ticks."""
    try:
        return int((task / "schedstat").read_text().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15 of stat)


class CpuProbe:
    """Snapshots of the CPU seconds used by a session's threads (role "server") and by this
    process's own threads (role "client")."""

    def __init__(self, sid: int | None) -> None:
        self.sid = sid

    def snapshot(self) -> Snapshot:
        out: Snapshot = defaultdict(float)
        if self.sid is not None:
            for pid in _session_pids(self.sid):
                _threads(pid, "server", out)
        _threads(os.getpid(), "client", out)
        return out

    @staticmethod
    def delta(before: Snapshot, after: Snapshot, output_tokens: int, wall_s: float) -> dict:
        """Rows of CPU seconds spent between two snapshots (largest first), each with its ms per
        output token and its share of one core over the wall time; totals per role."""
        rows: list[dict[str, Any]] = []
        for key, end in after.items():
            spent = end - before.get(key, 0.0)  # a thread born during the load started at 0
            if spent > 0:
                role, process, thread = key
                rows.append({"role": role, "process": process, "thread": thread, "cpu_s": round(spent, 3)})
        rows.sort(key=lambda r: -r["cpu_s"])
        for r in rows:
            r["ms_per_token"] = round(1e3 * r["cpu_s"] / max(output_tokens, 1), 4)
            r["cores"] = round(r["cpu_s"] / max(wall_s, 1e-9), 3)
        totals = {role: round(sum(r["cpu_s"] for r in rows if r["role"] == role), 3) for role in ("server", "client")}
        return {"wall_s": round(wall_s, 3), "output_tokens": output_tokens, "totals_s": totals, "threads": rows}


def table(cpu: dict, top: int = 12) -> str:
    """The breakdown as a markdown table (the `top` largest rows)."""
    lines = [
        f"CPU over the measured load: {cpu['wall_s']} s wall, {cpu['output_tokens']} output tokens; "
        f"server {cpu['totals_s']['server']} s, client {cpu['totals_s']['client']} s",
        "",
        "| role | process | thread | CPU s | ms / token | cores |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in cpu["threads"][:top]:
        lines.append(
            f"| {r['role']} | {r['process']} | {r['thread']} | {r['cpu_s']} | {r['ms_per_token']} | {r['cores']} |"
        )
    return "\n".join(lines)

"""The one result writer: a subcommand's dict plus where and how it was measured (machine, CPU
kind, commit, command line), as JSON at `--out`; and what the benchmarks' reports share:
percentiles, Markdown tables and doc sections, matplotlib without a display."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# CPU flags that decide which kernels run (AVX-512 GEMMs, bf16 dot products, AMX tiles).
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_kind() -> dict[str, Any]:
    """Vendor, family, model, model name, flags of interest and core count (Linux /proc/cpuinfo)."""
    info: dict[str, Any] = {"machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info.update(
        vendor=fields.get("vendor_id"),
        family=fields.get("cpu family"),
        model=fields.get("model"),
        model_name=fields.get("model name"),
        flags=[f for f in FLAGS_OF_INTEREST if f in fields.get("flags", "").split()],
    )
    return info


def commit() -> str | None:
    """The checkout's commit, `+dirty` when tracked files differ from it; None outside git."""
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Where and how a result was measured."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_kind(),
        "commit": commit(),
        "command": ["orcaserve-bench", *(sys.argv[1:] if argv is None else argv)],
    }


def write(path: str | os.PathLike, result: dict, argv: list[str] | None = None) -> dict:
    """`result` with its provenance under `"run"`, written as JSON to `path`; returns what was
    written. The result's own keys stay at the top level (readers of older files keep working)."""
    out = {**result, "run": provenance(argv)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str) + "\n")
    tmp.replace(path)
    return out


class Table(list):
    """Lines printed as they are measured and kept for the result (`{"table": [...]}`)."""

    def say(self, line: str) -> None:
        self.append(line)
        print(line, flush=True)


def pct(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) of `values`, linear between the two nearest ranks; None if empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def markdown_table(header: list[str], rows: list[list[Any]], align: str = "---") -> list[str]:
    """A Markdown table's lines: `header`, then one line per row (cells as `str` gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + f" {align} |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def update_doc(path: str, text: str, begin: str, end: str) -> None:
    """Replace what stands between the markers `begin` and `end` of the doc at `path` with `text`."""
    doc = Path(path).read_text()
    if begin not in doc or end not in doc:
        raise ValueError(f"{path} has no {begin} ... {end} section")
    head, rest = doc.split(begin, 1)
    Path(path).write_text(head + begin + "\n" + text + end + rest.split(end, 1)[1])


def machine() -> dict:
    """The machine a run was measured on, with a one-line `summary` for a report."""
    kind = cpu_kind()
    cpu, cores = kind.get("model_name") or kind["machine"], len(os.sched_getaffinity(0))
    mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    info = {"cpu": cpu, "cores": cores, "memory_gib": mem, "os": platform.platform(), "torch": None}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    info["summary"] = f"{cores} CPU cores ({cpu}), {mem} GiB, {info['os']}, torch {info['torch']}"
    return info

"""benchmarks/gpu_check.sh's dry run: every step of the GPU check (the Triton kernel tests, the
kernel timings, the engine end to end against transformers, throughput, the default model) runs
on the CPU under TRITON_INTERPRET=1 at tiny sizes. No GPU is lent to most sessions, so without
this the GPU scripts could break unnoticed until one is. No figure is asserted, only that every
step ran and its correctness checks passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "results"
    env = dict(
        os.environ,
        GPU_CHECK_DRY_RUN="1",
        GPU_CHECK_REAL="1",  # the default model too (gpu/exact.py's run_real), about a minute on the CPU
        GPU_CHECK_BUDGET_S="900",
        PY=sys.executable,
        TMPDIR=str(tmp_path),
    )
    run = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = {name: step["status"] for name, step in summary["steps"].items()}
    expected = {
        "tests",
        "engine_exact",
        "kernels",
        "engine_throughput",
        "engine_generate_batch",
        "startup",
        "lora",
        "ternary",
        "spec",
        "lora_engine",
        "engine_real",
    }
    assert set(steps) == expected, steps
    logs = "".join((out / f).read_text(errors="replace")[-2000:] for f in ("engine.log", "kernels.log", "tests.log"))
    assert all(status == "pass" for status in steps.values()), f"{steps}\n{logs}"
    assert summary["dry_run"] and summary["correctness_pass"] and summary["all_steps_completed"], summary

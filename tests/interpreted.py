"""Triton kernel tests on a CPU: TRITON_INTERPRET=1 only takes effect if it is set before the
kernels are defined, and another test module may already have defined them compiled, so a test
file runs its cases in one child process of itself (its `__main__` prints them as one JSON line),
or a script of its own in one (`run_script`)."""

import json
import os
import subprocess
import sys


def child_outcomes(path: str, timeout: int = 600) -> dict:
    """The JSON line `python path` prints under TRITON_INTERPRET=1."""
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports this module too
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    )
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(script: str, done: str, timeout: int) -> None:
    """`script` in a child process under TRITON_INTERPRET=1 (set before any kernel is defined),
    from the repository root; it must exit 0 and print `done`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert done in proc.stdout

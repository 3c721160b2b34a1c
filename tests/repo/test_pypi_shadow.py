"""Run from the checkout's root, the `kernels/` folder must not hide PyPI's `kernels` from transformers.

`python -c`, `python -m` and `python -m pytest` put the working directory first on sys.path. The
CI run of `make test` on 2026-12-03 failed to collect 17 test modules this way once transformers
5.25 began to depend on PyPI's `kernels`. Real interpreters, real packages, no mocks.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import kernels
import transformers.modeling_utils  # imports names from PyPI's kernels where it is installed
import orcaserve.kernels
from orcaserve.scheduler import Engine
print(kernels.__file__)
print("kernels.pypi_shadow" in sys.modules)
print(orcaserve.kernels.__file__)
"""


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow  # a fresh interpreter importing the kernels; the full suite runs it
def test_checkout_root_on_sys_path_keeps_pypi_kernels():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top_file, helper_left, ours_file = proc.stdout.split()
    top, ours = Path(top_file), Path(ours_file)
    assert ours == REPO / "kernels" / "__init__.py"
    if _installed("kernels"):
        assert top != ours, "top-level kernels is still the checkout's folder"
        assert helper_left == "False", "the checkout's helper is left as a submodule of PyPI's kernels"
    else:
        # Nothing to hand over to: the folder stays importable under both names, as before.
        assert top == ours


# Folders that land first on sys.path: `python benchmarks/x.py` puts the script's folder there, and
# pytest puts each test's folder there (rootdir-less `prepend` import mode) and tests/ (`pythonpath`).
SCRIPT_DIRS = sorted(
    str(folder.relative_to(REPO))
    for top in ("benchmarks", "tests")
    for folder in [REPO / top, *(REPO / top).rglob("*")]
    if folder.is_dir()
    and not any(part.startswith((".", "_")) for part in folder.relative_to(REPO).parts)
    and any(folder.glob("*.py"))
)


def test_script_folders_hide_no_installed_module():
    """A script or package in those folders named like an installed or standard module hides it.

    benchmarks/kernels.py (now gpu_kernels.py) hid PyPI's `kernels` from transformers in every
    `python benchmarks/...` that loads a model, which failed four steps of the GPU check's dry run.
    """
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    clashes = [
        f"{folder}/{entry.name}"
        for folder in SCRIPT_DIRS
        for entry in sorted((REPO / folder).iterdir())
        if (entry.suffix == ".py" or (entry / "__init__.py").is_file()) and entry.stem in taken
    ]
    assert not clashes, f"rename these, they shadow installed modules: {clashes}"

"""Hand the top-level name `kernels` back to PyPI's package when this checkout shadows it.

The mandated layout has a `kernels/` folder at the repository root, installed as
`orcaserve.kernels`. Run from the root, `python -m ...`, `python -c` and `python -m pytest` put the
working directory first on `sys.path`, so a plain `import kernels` finds that folder. transformers
>= 5.25 depends on PyPI's `kernels` (Hugging Face's hub kernels) and imports names from it while
`transformers.modeling_utils` loads; the folder has none of them, and every model import failed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def installed_kernels() -> ModuleType | None:
    """PyPI's `kernels`, loaded from `sys.path` without this checkout's root; None if not installed.

    Called only while this folder is being imported under the top-level name `kernels`. The caller
    puts the result into `sys.modules["kernels"]`, so the import that found the folder returns
    PyPI's module instead, whatever imported it first (transformers, a test, a user's script).
    """
    root = Path(__file__).resolve().parent.parent
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as the import system does, so its own `from kernels.x import y`
    # finds the package and not this folder.
    ours = sys.modules["kernels"]
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["kernels"] = ours
        raise
    return module

"""The kernels: attention backends (PyTorch twins, Triton, the C++ CPU operators) behind one contract
(`attention_backend.py`) and picked by name (`backends.py`), the CPU dispatch table (`dispatch.py`)
and the linear layers (`linear.py`)."""

import sys
from types import ModuleType

_pypi: ModuleType | None = None
if __name__ == "kernels":
    # Imported as top-level `kernels` from the checkout's root: PyPI's package owns that name
    # (see pypi_shadow.py), so the import that found this folder returns it instead.
    from .pypi_shadow import installed_kernels

    _pypi = installed_kernels()

if _pypi is not None:
    sys.modules[__name__] = _pypi
    # The helper was imported as a submodule of this folder; PyPI's package has no such module.
    del sys.modules[f"{__name__}.pypi_shadow"]
else:
    from orcaserve.kernels.attention_backend import AttentionBackend
    from orcaserve.kernels.backends import get_backend
    from orcaserve.kernels.pytorch.attention import TorchAttentionPlan, store_kv, unified_attention
    from orcaserve.kernels.pytorch.backend import TorchBackend

__all__ = [
    "AttentionBackend",
    "TorchAttentionPlan",
    "TorchBackend",
    "get_backend",
    "store_kv",
    "unified_attention",
]

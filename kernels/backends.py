"""The attention backends by name, above the implementations (the contract they share is
kernels/attention_backend.py). Each is imported when asked for: Triton is only needed on a GPU."""

from __future__ import annotations

from collections.abc import Callable

from orcaserve.kernels.attention_backend import AttentionBackend


def _cpu() -> AttentionBackend:
    """The C++ operator; the PyTorch path, with a warning saying why, if it cannot be built or loaded."""
    from orcaserve.kernels.cpu.attention import make_cpu_backend

    return make_cpu_backend()


def _torch() -> AttentionBackend:
    from orcaserve.kernels.pytorch.backend import TorchBackend

    return TorchBackend()


def _triton() -> AttentionBackend:
    from orcaserve.kernels.triton.backend import TritonBackend

    return TritonBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"cpu": _cpu, "torch": _torch, "triton": _triton}


def get_backend(name: str) -> AttentionBackend:
    """The backend `attention_backend` names: "cpu", "torch" or "triton"."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r} (expected 'cpu', 'torch' or 'triton')")
    return BACKENDS[name]()

"""Every ISA variant of the C++ CPU ops that this machine executes, for tests to parametrize over.

The library holds one overload per variant (`torch.ops.orcaserve.<op>.<variant>`,
kernels/cpu/build.py): an AVX-512 machine runs the avx2 and generic ones too, an AMX machine the
avx512 and avx512_bf16 ones, without environment switches. Importing this builds the library if
needed; `LOADED` is False (and `REASON` says why) where it cannot be built.
"""

from typing import Any

import pytest
import torch

from orcaserve.kernels.cpu import build

LOADED, REASON = build.load(build=True)


def variants(op: str) -> list[str]:
    """The variants of `op` loaded here, lowest first (empty where the library is not)."""
    packet = getattr(torch.ops.orcaserve, op, None) if LOADED else None
    return [v for v in build.built_variants() if packet is not None and hasattr(packet, v)]


def params(op: str) -> list[Any]:
    """`variants(op)` as pytest parameters, one test id per variant."""
    return [pytest.param(v, id=v) for v in variants(op)]


def op(name: str, variant: str) -> Any:
    return getattr(getattr(torch.ops.orcaserve, name), variant)

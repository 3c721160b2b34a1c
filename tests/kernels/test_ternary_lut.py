"""The lookup-table ternary GEMMs measured beside the vpdpbusd kernel (benchmarks/cpu/ternary_lut*.cpp,
docs/bitnet.md, "The kernel"): their int32 sums equal the PyTorch twin's at 2B4T's shapes and at odd
ones (partial panels, K not a multiple of a group), 1-33 rows, extreme activations. Slow: the
extension is compiled on first use (about a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orcaserve.bench.cpu import ternary_lut
from orcaserve.kernels import dispatch


def _cpu_has(*flags: str) -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {flag}" in text for flag in flags)


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_has("avx512bw", "avx512vbmi"), reason="the LUT kernels are AVX-512BW and VBMI")
@pytest.mark.skipif(dispatch.resolve("linear_ternary", "int8") == "torch", reason="no C++ ternary kernel to compare")
@pytest.mark.parametrize("shape", [*ternary_lut.SHAPES.values(), (100, 77), (33, 2567), (1, 5), (65, 6913)])
def test_lut_kernels_equal_the_twin(shape: tuple[int, int]) -> None:
    ternary_lut.check(ternary_lut.build(), *shape)  # raises SystemExit naming the kernel on a difference

"""The sampler's C++ argmax (kernels/cpu/csrc/fused/argmax.cpp, every ISA variant this machine
executes) against torch.argmax, in fp32 and bf16: the same index in every case torch defines, ties
(the first), NaN (the first NaN), -inf rows, widths that are not a multiple of the vector width.
Skipped if the library cannot be built (the sampler then uses ATen)."""

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params

from orcaserve.scheduler.model.sampler import argmax_ops, argmax_rows

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)
VARIANTS = params("argmax_rows")


def ops(variant):
    return {dt: op("argmax_rows", variant) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (32, 49152), (5, 1000), (2, 16), (4, 33)])
def test_matches_torch(shape, dtype, variant):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g).to(dtype)  # bf16: many ties among rounded values too
    assert torch.equal(argmax_rows(x, ops(variant)), x.argmax(-1))
    # coarse values: many ties, the first one counts
    x = torch.randint(0, 3, shape, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x, ops(variant)), x.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_special_values(dtype, variant):
    x = torch.randn(6, 100)
    x[0, 40] = float("nan")
    x[1, [7, 90]] = float("nan")
    x[1, 3] = float("inf")
    x[2] = float("-inf")
    x[3, 99] = float("inf")
    x[4] = 0.0
    x[4, 50] = -0.0
    x[5, 17] = float("nan")
    x[5, 0] = float("inf")
    x = x.to(dtype)
    assert torch.equal(argmax_rows(x, ops(variant)), x.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_rejects_what_it_does_not_compute(variant):
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op("argmax_rows", variant)(torch.randn(2, 8).half())
    # the sampler's wrapper sends such input to ATen instead
    x = torch.randn(4, 8)
    assert torch.equal(argmax_rows(x.t(), ops(variant)), x.t().argmax(-1))
    assert torch.equal(argmax_rows(x.half(), ops(variant)), x.half().argmax(-1))


def test_sampler_takes_the_dispatch_tables_variant():
    """Without an override the sampler runs the variant kernels/dispatch.py picks."""
    from orcaserve.kernels import dispatch

    for dt, got in argmax_ops().items():
        assert got is op("argmax_rows", dispatch.resolve("argmax_rows", dt).rsplit(".", 1)[1])

"""The sampler's C++ argmax (kernels/cpu_argmax.cpp) against torch.argmax, in fp32 and bf16: the
same index in every case torch defines, ties (the first), NaN (the first NaN), -inf rows, widths that are not a
multiple of the vector width. Skipped if the library cannot be built (the sampler then uses ATen)."""

import pytest
import torch

from orcaserve.kernels.cpu import build as ca
from orcaserve.scheduler.model.sampler import argmax_rows

OP, REASON = ca.load_cpu_ops(build=True)
if OP is None or not ca.has_op("argmax_rows"):
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (32, 49152), (5, 1000), (2, 16), (4, 33)])
def test_matches_torch(shape, dtype):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g).to(dtype)  # bf16: many ties among rounded values too
    assert torch.equal(argmax_rows(x, fast=True), x.argmax(-1))
    # coarse values: many ties, the first one counts
    x = torch.randint(0, 3, shape, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x, fast=True), x.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_special_values(dtype):
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
    assert torch.equal(argmax_rows(x, fast=True), x.argmax(-1))


def test_rejects_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.orcaserve.argmax_rows(torch.randn(2, 8).half())
    # the sampler's wrapper sends such input to ATen instead
    x = torch.randn(4, 8)
    assert torch.equal(argmax_rows(x.t(), fast=True), x.t().argmax(-1))
    assert torch.equal(argmax_rows(x.half(), fast=True), x.half().argmax(-1))

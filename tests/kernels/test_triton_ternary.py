"""BitNet's ternary GEMM in Triton (kernels/triton/ternary.py) against the PyTorch twin, bit for
bit: run by Triton's CPU interpreter (or compiled on a GPU with ORCASERVE_TEST_DEVICE=cuda).

TRITON_INTERPRET=1 only takes effect if it is set before the kernels are defined, and another test
module may already have defined them compiled, so on the CPU the checks run in one child process
(`python tests/kernels/test_triton_ternary.py`) that prints each case's outcome as a JSON line.
Integers only: the interpreter computes them as the GPU does.
"""

import json
import os

import pytest
from interpreted import child_outcomes

DEVICE = os.environ.get("ORCASERVE_TEST_DEVICE", "cpu")

# (rows, outputs, inputs): one row; a column count not a multiple of 4 or of the tile; depths
# short of, equal to and past the tile; BitNet 2B4T's q/k/v width at a decode's rows.
SHAPES = [(1, 7, 5), (3, 130, 200), (16, 64, 64), (17, 250, 129), (4, 3840, 2560)]


def _cases() -> dict[str, bool]:
    import torch

    from orcaserve.kernels.ternary import TernaryLinear
    from orcaserve.kernels.triton.ternary import pack_ternary, ternary_int_mm

    g = torch.Generator().manual_seed(0)
    out = {}
    for m, n, k in SHAPES:
        w = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
        x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        want = TernaryLinear(w, torch.ones(n), kernel="torch").int_sums(x)
        got = ternary_int_mm(x.to(DEVICE), pack_ternary(w.to(DEVICE)), n).cpu()
        out[f"{m}x{n}x{k}"] = torch.equal(got, want)
    # extremes: -128 against all -1 sums to the largest int32 of a row; a strided activation view
    w = -torch.ones((40, 300), dtype=torch.int8)
    x = torch.full((5, 600), -128, dtype=torch.int8)[:, ::2]  # [5, 300], row stride 600, column stride 2
    want = TernaryLinear(w, torch.ones(40), kernel="torch").int_sums(x.contiguous())
    out["extremes, strided"] = torch.equal(ternary_int_mm(x.to(DEVICE), pack_ternary(w.to(DEVICE)), 40).cpu(), want)
    # the layer end to end: the Triton kernel against the twin's output, fp32 and scales per column
    w = torch.randint(-1, 2, (96, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(96, generator=g) + 0.5
    xf = torch.randn(3, 64, generator=g)
    twin = TernaryLinear(w, scale, kernel="torch")(xf)
    tri = TernaryLinear(w.to(DEVICE), scale.to(DEVICE), kernel="triton")(xf.to(DEVICE)).cpu()
    out["TernaryLinear"] = torch.equal(tri, twin)
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[str, bool]:
    return _cases() if DEVICE != "cpu" else child_outcomes(__file__, timeout=600)


@pytest.mark.slow  # the Triton interpreter in a child process (~10 s); the full suite runs it
@pytest.mark.parametrize("case", [f"{m}x{n}x{k}" for m, n, k in SHAPES] + ["extremes, strided", "TernaryLinear"])
def test_triton_ternary_equals_the_twin(outcomes, case):
    assert outcomes[case], case


def test_pack_refuses_a_value_outside_ternary():
    import torch

    from orcaserve.kernels.triton.ternary import pack_ternary

    with pytest.raises(ValueError, match="outside"):
        pack_ternary(torch.tensor([[2, 0]], dtype=torch.int8))


if __name__ == "__main__":
    print(json.dumps(_cases()))

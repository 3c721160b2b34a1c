"""The lm_head's argmax taken inside the int8-activation GEMM (`linear_int8_argmax`,
kernels/cpu/csrc/gemm/int8_out.h; docs/one-stream.md "The argmax inside the lm_head"): for every ISA
variant this CPU runs, torch.argmax of the output `linear_int8` stores (bf16 rounded for bf16 x), in
every case torch defines: ties (the first, within a panel and across panels, and values that only
tie once rounded to bf16), -inf rows, NaN (the first), +-0, widths that end in a part panel."""

from __future__ import annotations

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params
from test_quant_gemm import random_codes

from orcaserve.kernels.quant import BITS, OFFSET, WIDE, QuantLinear

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)
VARIANTS = params("linear_int8_argmax")
INF, NAN = float("inf"), float("nan")


def _both(variant, fmt, n, x, bias):
    """(linear_int8's output, linear_int8_argmax's indices) of x against random codes [n, K]."""
    codes = random_codes(fmt, n, x.shape[1], n)
    pack = op("pack_int8_weight", variant)
    w = pack(codes.q, codes.scale, codes.offset, BITS[fmt], fmt in WIDE)
    args = (w, bias, n, BITS[fmt], fmt in OFFSET, fmt in WIDE)
    return op("linear_int8", variant)(x, *args), op("linear_int8_argmax", variant)(x, *args)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("fmt", "n"), [("q8_0", 256), ("q8_0", 100), ("q4_1", 1000), ("q4_0", 33), ("q6_k", 64)])
def test_argmax_of_the_stored_output(variant, dtype, fmt, n):
    """Random rows (1, a tile's 8, 17: more than a tile), with and without a bias."""
    g = torch.Generator().manual_seed(n)
    k = 256
    for rows in (1, 8, 17):
        x = torch.randn(rows, k, generator=g).to(dtype)
        for bias in (None, torch.randn(n, generator=g)):
            y, got = _both(variant, fmt, n, x, bias)
            assert got.dtype == torch.int64 and torch.equal(got, y.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [256, 100])  # whole panels; a part panel at the end
def test_ties_and_special_values(variant, dtype, n):
    """Zero rows of x give the bias itself: each case a bias row that torch.argmax decides."""
    x = torch.zeros(3, 64, dtype=dtype)
    cases = {
        "tie across panels": {5: 3.0, 70: 3.0},
        "tie within a panel": {40: 2.0, 41: 1.0, 45: 2.0},
        "tie only in bf16": {10: 1.0, 11: 1.001},  # 1.001 rounds to 1.0 in bf16
        "all -inf": dict.fromkeys(range(n), -INF),
        "-inf but one": {**dict.fromkeys(range(n), -INF), 77: -5.0},
        "first NaN": {3: INF, 40: NAN, 90: NAN},
        "NaN in the last panel": {1: INF, 99: NAN},
        "+-0": dict.fromkeys(range(n), -0.0),
    }
    for name, values in cases.items():
        bias = torch.zeros(n)
        for i, v in values.items():
            if i < n:
                bias[i] = v
        y, got = _both(variant, "q8_0", n, x, bias)
        assert torch.equal(got, y.argmax(-1)), name
    y, got = _both(variant, "q8_0", n, torch.zeros(0, 64, dtype=dtype), None)
    assert got.shape == (0,)


@pytest.mark.parametrize("variant", VARIANTS)
def test_quant_linear_argmax(variant):
    """QuantLinear.argmax over the C++ GEMM; None where its kernel has no fused argmax (the twin)."""
    codes = random_codes("q8_0", 96, 128, 1)
    x = torch.randn(4, 128).bfloat16()
    fused = QuantLinear(codes, None, kernel=f"orcaserve.linear_int8.{variant}", activations="int8")
    assert torch.equal(fused.argmax(x), fused(x).argmax(-1))
    assert QuantLinear(codes, None, kernel="torch", activations="int8").argmax(x) is None

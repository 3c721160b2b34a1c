"""BitNet's ternary GEMM (csrc/gemm/gemm_ternary.cpp, docs/bitnet.md): the int32 sums of every ISA
variant this CPU runs equal torch._int_mm's over the same int8 values (the twin), for shapes that
leave partial panels (a panel is two column vectors: a partial first half, an empty second one),
partial 16-k groups and row tiles of every height (1-8) and every split of 1-40 rows; weights
outside {-1, 0, 1} refused. The whole layer in one call (`bitlinear_ternary`: quantization, GEMM and
scales in float or bf16) is the PyTorch path's output bit for bit."""

from __future__ import annotations

import pytest
import torch
from cpu_variants import op, params

from orcaserve.kernels.pytorch.fused import rms_norm
from orcaserve.kernels.ternary import TernaryLinear
from orcaserve.scheduler.model.bitnet import relu2_mul

TERNARY = params("linear_ternary")
SHAPES = [(16, 16), (72, 48), (3840, 2560), (33, 100), (8, 6912)]  # (N, K)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 64]


def _case(n: int, k: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    x = torch.randint(-128, 128, (t, k), generator=g, dtype=torch.int8)
    return w, x


@pytest.mark.parametrize("variant", TERNARY)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_is_the_twin_bit_for_bit(variant, shape):
    n, k = shape
    packed = op("pack_ternary_weight", variant)(_case(n, k, 1, 0)[0])
    for t in ROWS if n * k < 1 << 22 else [1, 5]:
        w, x = _case(n, k, t, t)
        packed = op("pack_ternary_weight", variant)(w)
        got = op("linear_ternary", variant)(x, packed, n)
        assert got.dtype == torch.int32 and got.shape == (t, n)
        assert torch.equal(got, torch._int_mm(x, w.t().contiguous())), (variant, shape, t)


# (N, K) around a panel's edges (32 columns on AVX-512, 16 on AVX2, two vectors each) and a 16-k
# group's: the second half partial, empty, or the panel whole; K under, at and over a group.
EDGES = [(1, 1), (17, 15), (31, 17), (33, 16), (40, 100), (65, 33), (96, 48)]


@pytest.mark.parametrize("variant", TERNARY)
@pytest.mark.parametrize("shape", EDGES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_count_at_the_panel_edges(variant, shape):
    """Rows 1-40: one tile of each height, then tiles spread evenly (33 rows: 7, 7, 7, 6, 6), with
    split sums for 1-3 rows; every one the twin's bit for bit."""
    n, k = shape
    w, x = _case(n, k, 40, n * k)
    packed = op("pack_ternary_weight", variant)(w)
    want = torch._int_mm(x, w.t().contiguous())
    for t in range(1, 41):
        got = op("linear_ternary", variant)(x[:t], packed, n)
        assert torch.equal(got, want[:t]), (variant, shape, t)


def _activations(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of every kind the quantization meets: Gaussian at several magnitudes, all zeros (a
    step's pad row), under the 1e-5 clamp, one outlier, ties for the rounding (multiples of 1/2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 3, t).reshape(t, 1)
    kinds = [torch.zeros(k), torch.randn(k, generator=g) * 3e-6, torch.randn(k, generator=g).round() / 2]
    for i, row in enumerate(kinds[: max(0, t - 1)]):
        x[i + 1] = row
    x[0, k // 2] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize("variant", TERNARY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(40, 100), (65, 33), (3840, 2560), (96, 6912)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_whole_layer_is_the_pytorch_path(variant, dtype, shape):
    n, k = shape
    w, _ = _case(n, k, 1, n + k)
    col_scale = torch.rand(n, generator=torch.Generator().manual_seed(k)) + 0.5
    twin = TernaryLinear(w, col_scale, kernel="torch")
    packed = op("pack_ternary_weight", variant)(w)
    scale = col_scale.to(dtype)
    for t in (1, 3, 9, 33):
        x = _activations(t, k, dtype, t)
        got = op("bitlinear_ternary", variant)(x, packed, n, scale)
        want = twin(x)
        assert got.dtype == dtype and torch.equal(got, want), (variant, dtype, shape, t)


@pytest.mark.parametrize("variant", TERNARY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [7, 100, 2560, 6912])
def test_the_sub_norm_in_the_call_is_the_pytorch_ops(variant, dtype, k):
    """BitNet's sub-layer norm (of x, or of relu(gate)^2 * up) inside the layer's call: the PyTorch
    ops' output bit for bit. Widths under a vector, with a vector tail, the 2B4T's two; 33 rows of
    6912 are summed by ATen on several threads (a row each)."""
    n, g = 40, torch.Generator().manual_seed(k)
    w, _ = _case(n, k, 1, k)
    col_scale, norm = torch.rand(n, generator=g) + 0.5, (torch.rand(k, generator=g) + 0.5).to(dtype)
    twin = TernaryLinear(w, col_scale, kernel="torch")
    packed = op("pack_ternary_weight", variant)(w)
    for t in (1, 3, 33):
        for relu2 in (False, True):
            x = _activations(t, 2 * k if relu2 else k, dtype, t)
            got = op("bitlinear_ternary", variant)(x, packed, n, col_scale.to(dtype), norm, 1e-5, relu2)
            want = twin(rms_norm(relu2_mul(x) if relu2 else x, norm, 1e-5))
            assert got.dtype == dtype and torch.equal(got, want), (variant, dtype, k, t, relu2)


@pytest.mark.parametrize("variant", TERNARY)
def test_extreme_activations_never_saturate(variant):
    """vpmaddubsw sums pairs in int16: codes 2 against -128 twice is -512; without VNNI 16 groups'
    64 pairs are summed in int16 before widening, -32768 at worst: K = 512 reaches it twice."""
    k = 512
    w = torch.ones(32, k, dtype=torch.int8)
    x = torch.full((3, k), -128, dtype=torch.int8)
    x[1] = 127
    got = op("linear_ternary", variant)(x, op("pack_ternary_weight", variant)(w), 32)
    assert got[:, 0].tolist() == [-128 * k, 127 * k, -128 * k]
    w2 = -w
    got2 = op("linear_ternary", variant)(x, op("pack_ternary_weight", variant)(w2), 32)
    assert got2[:, 0].tolist() == [128 * k, -127 * k, 128 * k]


@pytest.mark.parametrize("variant", TERNARY)
def test_a_weight_outside_ternary_is_refused(variant):
    w = torch.zeros(16, 16, dtype=torch.int8)
    w[3, 5] = 2
    with pytest.raises(RuntimeError, match="outside"):
        op("pack_ternary_weight", variant)(w)


def test_layer_uses_the_table_and_packs_two_bits_a_weight():
    """Where the library has the kernel, the layer holds a quarter of a byte a weight; its output
    is the twin's either way (the layer tests in tests/model/test_bitnet.py)."""
    w, x = _case(72, 48, 5, 1)
    layer = TernaryLinear(w, torch.full((72,), 0.5))
    want = torch._int_mm(x, w.t().contiguous())
    assert torch.equal(layer.int_sums(x), want)
    if layer.kernel != "torch":
        assert layer.weight.dtype == torch.uint8 and layer.nbytes() < 72 * 48 // 2
    twin = TernaryLinear(w, torch.full((72,), 0.5), kernel="torch")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one call for the first two
        xf = _activations(5, 48, dtype, 2)
        assert torch.equal(layer(xf), twin(xf)), dtype

"""GGUF block formats served quantized (kernels/quant.py): dequantization bit for bit gguf-py's,
quantization as llama.cpp's reference quantizers, and the C++ GEMM over packed codes bit for bit
the project's fp32 GEMM on the dequantized weight (docs/kernels.md, "Quantized GEMM on the CPU")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cpu_variants import params

from orcaserve.kernels import dispatch
from orcaserve.kernels.linear import Linear
from orcaserve.kernels.quant import (
    FORMATS,
    GROUP,
    QUANTIZERS,
    SPAN,
    BlockCodes,
    QuantLinear,
    concat,
    dequantize,
    quantize,
    take_rows,
)

gguf = pytest.importorskip("gguf")
QGEMM = params("linear_quant")
ROWS = [*range(1, 41), 97, 256, 512]  # decode batches, and prefill chunks
_QTYPE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def random_codes(fmt: str, n: int, k: int, seed: int = 0) -> BlockCodes:
    """Codes over the format's whole range, fp16-representable scales (and mins) of both signs; the
    K-quants' scales (mins) fp32 products of an fp16 value and their 6-bit (q6_k: int8) sub-scale."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = {"q8_0": (-128, 127), "q4_0": (-8, 7), "q4_1": (0, 15), "q4_k": (0, 15), "q6_k": (-32, 31)}[fmt]
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    span = SPAN.get(fmt, GROUP)
    scale = (torch.randn(n, k // span, generator=g) * 0.01).half().float()
    offset = (torch.randn(n, k // GROUP, generator=g) * 0.05).half().float() if fmt in ("q4_1", "q4_k") else None
    if fmt == "q4_k":
        scale = scale.abs() * torch.randint(0, 64, scale.shape, generator=g).float()
        offset = -(offset.abs() * torch.randint(0, 64, scale.shape, generator=g).float())
    elif fmt == "q6_k":
        scale = scale.abs() * torch.randint(-128, 128, scale.shape, generator=g).float()
    return BlockCodes(fmt, q, scale, offset)


def gguf_bytes(codes: BlockCodes) -> np.ndarray:
    """The codes as a GGUF file stores them: per block d (fp16), m (q4_1), then the codes: int8, or
    nibbles q + 8 (q4_0) / q (q4_1), element j in the low half of byte j, element j + 16 in the high."""
    n, k = codes.shape
    nb = k // GROUP
    head = [codes.scale.half().numpy().view(np.uint8).reshape(n, nb, 2)]
    if codes.offset is not None:
        head.append(codes.offset.half().numpy().view(np.uint8).reshape(n, nb, 2))
    q = codes.q.numpy().reshape(n, nb, GROUP)
    if codes.fmt == "q8_0":
        body = q.view(np.uint8)
    else:
        u = (q + (8 if codes.fmt == "q4_0" else 0)).astype(np.uint8)
        body = u[..., :16] | (u[..., 16:] << np.uint8(4))
    return np.concatenate([*head, body], axis=-1).reshape(n, -1)


@pytest.mark.parametrize("fmt", QUANTIZERS)  # the K-quants' parse + dequantize: test_kquants.py
def test_dequantize_is_gguf_py_bit_for_bit(fmt):
    codes = random_codes(fmt, 40, 256)
    want = gguf.quants.dequantize(gguf_bytes(codes), getattr(gguf.GGMLQuantizationType, _QTYPE[fmt]))
    got = dequantize(codes)
    assert got.dtype == torch.float32 and got.shape == (40, 256)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", QUANTIZERS)
def test_quantize_is_llama_cpp_reference(fmt):
    """Bytes equal to gguf-py's port of quantize_row_*_ref (its Q8_0 says bit-exact with ggml), on
    weights with ties, zero blocks and outliers; the roundtrip error within half a step (plus the
    scale's fp16 rounding)."""
    torch.manual_seed(1)
    w = torch.randn(24, 512) * 0.02
    w[0, :32] = 0  # a zero block: d = 0, codes 0 (q4_0: the nibble 8)
    w[1, :32] = torch.arange(32) / 31 * 0.1  # evenly spaced: rounding ties
    w[2, 5] = 3.0  # an outlier
    codes = quantize(w, fmt)
    want = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, _QTYPE[fmt]))
    assert np.array_equal(gguf_bytes(codes), want)
    lo, hi = {"q8_0": (-128, 127), "q4_0": (-8, 7), "q4_1": (0, 15)}[fmt]
    assert int(codes.q.min()) >= lo and int(codes.q.max()) <= hi
    err = (dequantize(codes) - w).abs().view(24, -1, GROUP).amax(-1)
    step = codes.scale.abs() * (1 + 2**-10)
    bound = step * (0.5 if fmt != "q4_0" else 1.0) + w.abs().view(24, -1, GROUP).amax(-1) * 2**-10
    assert bool((err <= bound + 1e-7).all())


def test_quantize_hand_case():
    """One block by hand, llama.cpp's arithmetic: q8_0 d = 127 / 127 = 1, codes round(x) with
    halves away from zero; q4_0 d = max / -8 on the signed peak; q4_1 d = (max - min) / 15."""
    x = torch.tensor([[127.0, -2.5, 2.5, 0.5, -0.5, 1.49] + [0.0] * 26])
    c8 = quantize(x, "q8_0")
    assert c8.scale.item() == 1.0 and c8.q[0, :6].tolist() == [127, -3, 3, 1, -1, 1]
    y = torch.tensor([[-16.0, 8.0, 2.0, -3.0, 15.0] + [0.0] * 27])  # d = -16 / -8 = 2, id = 0.5
    c4 = quantize(y, "q4_0")  # trunc(x * 0.5 + 8.5) - 8, at most 7
    assert c4.scale.item() == 2.0 and c4.q[0, :5].tolist() == [-8, 4, 1, -1, 7]
    z = torch.tensor([[0.0, 15.0, 7.5, 7.4] + [1.0] * 28])  # d = 1, m = 0
    c1 = quantize(z, "q4_1")
    assert c1.scale.item() == 1.0 and c1.offset is not None and c1.offset.item() == 0.0
    assert c1.q[0, :5].tolist() == [0, 15, 8, 7, 1]


def test_concat_and_take_rows():
    a, b = random_codes("q4_1", 8, 64, 1), random_codes("q4_1", 5, 64, 2)
    both = concat([a, b])
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    idx = torch.tensor([12, 0, 3, 3])
    assert torch.equal(dequantize(take_rows(both, idx)), dequantize(both)[idx])
    with pytest.raises(ValueError):
        concat([a, random_codes("q4_0", 8, 64)])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_twin_within_its_tolerance(fmt, dtype):
    """The fallback: F.linear in fp32 on the dequantized weight, within fp32 rounding of an fp64 sum."""
    codes, k = random_codes(fmt, 37, 128, 3), 128
    bias = torch.randn(37)
    lin = QuantLinear(codes, bias, kernel="torch")
    assert lin.kernel == "torch" and lin.nbytes() == 37 * k * 4
    x = torch.randn(5, k).to(dtype)
    got = lin(x)
    assert got.dtype == dtype
    want = x.double() @ dequantize(codes).double().t() + bias.double()
    w = dequantize(codes)
    atol = 1e-5 * math.sqrt(k) * float(x.float().abs().max()) * float(w.abs().max())
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want.to(dtype), atol=atol, rtol=1e-2)
    else:
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_kernel_is_the_dispatch_tables(fmt):
    codes = random_codes(fmt, 24, 64)
    row = dispatch.choice("linear_quant", fmt)
    assert row is not None
    want = row.runs if dispatch.available(row.runs) else "torch"
    assert QuantLinear(codes, None).kernel == want


@pytest.mark.parametrize("variant", QGEMM)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_is_the_fp32_gemm_on_dequantized_weights_bit_for_bit(variant, fmt):
    """QuantLinear on the C++ op against the project's fp32 GEMM (same variant) on dequantize(codes):
    equal bits at every row count (row tiles of each height), an odd N (the last panel partial), K
    over several widening chunks, with and without bias; bf16 x: that fp32 result on x.float(),
    rounded once to bf16."""
    n, k = 77, 320
    codes = random_codes(fmt, n, k, 5)
    for bias in (torch.randn(n), None):
        lin = QuantLinear(codes, bias, kernel=f"orcaserve.linear_quant.{variant}")
        ref = Linear(dequantize(codes), bias, pack=True, kernel=f"orcaserve.linear_packed.{variant}")
        assert lin.kernel.endswith(variant) and ref.kernel.endswith(variant)
        for rows in ROWS if bias is not None else (1, 5, 33):
            x = torch.randn(rows, k)
            want = ref(x)
            assert torch.equal(lin(x), want), (rows, "fp32")
            xb = x.bfloat16()
            got = lin(xb)
            assert got.dtype == torch.bfloat16 and torch.equal(got, ref(xb.float()).bfloat16()), (rows, "bf16")
        torch.testing.assert_close(
            lin(x), x @ dequantize(codes).t() + (0 if bias is None else bias), atol=1e-3, rtol=1e-4
        )


@pytest.mark.parametrize("variant", QGEMM)
def test_packed_size_and_checks(variant):
    """Packed as GGUF's own bits per weight (fp16 scales: 8.5, 4.5, 5; the last panel padded), the
    K-quants with fp32 scales (q4_k 6, q6_k 10), and codes out of range or scales that are not fp16
    values refused at packing."""
    cols = 24 if variant == "avx2" else 48
    for fmt, bits in (("q8_0", 8.5), ("q4_0", 4.5), ("q4_1", 5.0), ("q4_k", 6.0), ("q6_k", 10.0)):
        lin = QuantLinear(random_codes(fmt, 2 * cols, 64), None, kernel=f"orcaserve.linear_quant.{variant}")
        assert lin.nbytes() * 8 == 2 * cols * 64 * bits
    pack = getattr(torch.ops.orcaserve.pack_quant_weight, variant)
    c = random_codes("q4_0", 8, 64)
    with pytest.raises(RuntimeError, match="range"):
        pack(c.q + 8, c.scale, None, 4)
    with pytest.raises(RuntimeError, match="fp16"):
        pack(c.q, c.scale + 1e-6, None, 4)
    c6 = random_codes("q6_k", 8, 64)
    with pytest.raises(RuntimeError, match="range"):
        pack(c6.q + 32, c6.scale, None, 8, True)

"""The bf16 GEMM that reads a LoRA step's adapters into cache while it runs
(kernels/cpu/csrc/gemm/ahead.h, `linear_packed_bf16_ahead`; docs/lora.md "Reading the adapters
during the base GEMM"): bit for bit the plain GEMM, whatever it is given to read, on every variant
this machine executes; `Linear.ahead` runs it only where the dispatch table names it."""

from __future__ import annotations

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params

from orcaserve.kernels import dispatch
from orcaserve.kernels.linear import GEMV_ROWS, Linear

pytestmark = pytest.mark.skipif(not LOADED, reason=REASON)
AHEAD = params("linear_packed_bf16_ahead")


def _tensors() -> list[list[torch.Tensor]]:
    """What a call may be given to read: nothing, one tensor, or several of any dtype and layout
    (a transposed view as the stacks' B, an empty tensor, a scalar, an offset slice)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 4, 96, generator=g).bfloat16()
    bt = torch.randn(16, 4, 200, generator=g).bfloat16().permute(2, 0, 1)  # [out, S, R] over [S, R, out]
    return [
        [],
        [a],
        [a, bt, torch.randn(3, 5, generator=g), torch.empty(0), torch.tensor(2.0), torch.randn(1000, generator=g)[7:]],
    ]


@pytest.mark.skipif(not AHEAD, reason="the vdpbf16ps GEMM needs AVX-512 BF16")
@pytest.mark.parametrize("variant", AHEAD)
def test_the_gemm_reading_ahead_is_the_gemm_bit_for_bit(variant):
    """Every tile height, a partial last panel, bias or none, the GEMV-shaped rows and the tiled ones,
    one thread and several: the same bits as `linear_packed_bf16`."""
    torch.manual_seed(0)
    plain, ahead = op("linear_packed_bf16", variant), op("linear_packed_bf16_ahead", variant)
    pack = op("pack_linear_weight_bf16", variant)
    threads = torch.get_num_threads()
    try:
        for out_f, in_f in ((200, 96), (49, 576), (5, 34)):
            weight, bias = torch.randn(out_f, in_f).bfloat16(), torch.randn(out_f).bfloat16()
            packed, batch = pack(weight), torch.randn(70, in_f).bfloat16()
            for b in (bias, None):
                for n in sorted({1, threads}):
                    torch.set_num_threads(n)
                    for rows in (*range(1, 18), 32, 33, 70):
                        want = plain(batch[:rows], packed, b, out_f)
                        for tensors in _tensors():
                            got = ahead(batch[:rows], packed, b, out_f, tensors)
                            assert torch.equal(got, want), (out_f, in_f, rows, len(tensors))
    finally:
        torch.set_num_threads(threads)


def test_the_table_names_it_where_linear_runs_the_vdpbf16ps_gemm():
    for cap in ("generic", "avx2", "avx512"):
        assert dispatch.choice("linear_ahead", torch.bfloat16, cap).runs == "torch"
    for cap in ("avx512_bf16", "amx"):
        assert dispatch.choice("linear_ahead", torch.bfloat16, cap).runs == f"orcaserve.linear_packed_bf16_ahead.{cap}"
    assert dispatch.choice("linear_ahead", torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_ahead_is_the_plain_call(dtype):
    """`Linear.ahead` gives `Linear(x)`'s bits at every row count, through the op where this layer's
    GEMM is the table's vdpbf16ps one and the step has more than GEMV_ROWS rows, else the plain call."""
    torch.manual_seed(0)
    lin = Linear(torch.randn(100, 64).to(dtype), None, pack=True)
    vdp = lin.kernel.startswith("orcaserve.linear_packed_bf16.")
    assert (lin._ahead_op is not None) == (vdp and dispatch.resolve("linear_ahead", dtype) != "torch")
    calls = []
    if lin._ahead_op is not None:
        real = lin._ahead_op
        lin._ahead_op = lambda *args: calls.append(args[0].shape[0]) or real(*args)
    x, tensors = torch.randn(40, 64).to(dtype), [torch.randn(8, 64).to(dtype)]
    for rows in (1, GEMV_ROWS, GEMV_ROWS + 1, 40):
        assert torch.equal(lin.ahead(x[:rows], tensors), lin(x[:rows]))
    assert lin.ahead(x, []).shape == (40, 100)
    assert calls == ([GEMV_ROWS + 1, 40] if lin._ahead_op is not None else [])

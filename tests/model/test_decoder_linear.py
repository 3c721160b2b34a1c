"""The lean decoder's GEMMs: which library and weight copy a step's row count runs from, and the warm-up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_variants import params

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.kernels import dispatch
from orcaserve.kernels.linear import GEMV_ROWS, MKL_PACK_ROWS, PLAIN_FROM_ROWS, Linear, takes
from orcaserve.scheduler.model.decoder import Decoder
from orcaserve.scheduler.model.row_padding import PAD_MULTIPLE, padded_tokens

# The project's GEMMs, every ISA variant this machine executes (kernels/cpu/build.py)
FP32_GEMM = params("linear_packed")
BF16_GEMM = params("linear_packed_bf16")


def panel(variant: str) -> int:
    """Output columns per panel of the fp32 GEMM: three vector registers of the variant's ISA."""
    return 24 if variant == "avx2" else 48


needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")
# oneDNN packs bf16 weights only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (not on AMD Zen 3)
BF16_PACKS = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not BF16_PACKS, reason="oneDNN cannot pack bf16 on this CPU")
def test_linear_runs_large_steps_from_the_plain_weight():
    """Below `plain_from` rows the packed weight (oneDNN's inner product), from it on F.linear over
    the plain one: each path gives exactly what it gives on its own."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    lin = Linear(weight, bias, pack=True, plain_from=64, kernel="onednn")
    assert lin.onednn and lin.plain is not None
    for rows in (1, 63, 64, 100):
        x = torch.randn(rows, 96).bfloat16()
        got = lin(x)
        packed = torch.ops.mkldnn._linear_pointwise(x, lin.weight, bias, "none", [], "")
        want = F.linear(x, weight, bias) if rows >= 64 else packed
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=0.1, rtol=0.02)
    assert Linear(weight, bias, pack=True, kernel="onednn").plain is None  # no second copy unless asked


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL not built in")
@pytest.mark.skipif(not dispatch.available("mkl"), reason="MKL runs on Intel CPUs only (kernels/dispatch.py)")
def test_fp32_runs_mkl_packed_at_every_row_count():
    """fp32 weights are packed once by MKL for `MKL_PACK_ROWS` rows and the packed copy serves
    every row count a step brings: a layout that depended on the count would give wrong sums, not
    last-bit differences. No plain copy is kept."""
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    lin = Linear(weight.clone(), bias.clone(), pack=True, plain_from=64, kernel="mkl")
    assert lin.kernel == "mkl" and lin.plain is None and lin.shape_of.stride() == (0, 0)
    for rows in sorted({padded_tokens(t, PAD_MULTIPLE[torch.float32]) for t in range(1, 513)} | {MKL_PACK_ROWS}):
        x = torch.randn(rows, 96)
        want = (x.double() @ weight.double().t() + bias.double()).float()
        got = lin(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert Linear(weight.bfloat16(), None, pack=True, kernel="mkl").kernel != "mkl"  # fp32 only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_default_kernel_is_the_dispatch_tables(dtype):
    """Without an override a layer runs the dispatch table's kernel for this CPU where it takes the
    weight, else the row's first fallback that does."""
    weight = torch.randn(64, 96).to(dtype)
    row = dispatch.choice("linear", dtype)
    assert row is not None
    want = next((k for k in (row.runs, *row.fallbacks) if takes(k, weight)), "torch")
    assert Linear(weight, None, pack=True).kernel == want
    assert Linear(weight, None, pack=False).kernel == "torch"


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_copies_only_for_bf16_narrow_outputs(dtype, monkeypatch):
    """o_proj and down_proj keep a plain copy in bf16 only (where oneDNN's packed inner product
    loses at prefill sizes); where oneDNN runs the GEMMs the warm-up calls every GEMM at every
    padded row count. Where the project's GEMMs run bf16 or the CPU cannot pack it, one copy each and
    nothing is warmed up."""
    decoder = Decoder(tiny_model("llama").to(dtype))
    layer = decoder.layers[0]
    bf16 = dtype == torch.bfloat16
    kernel = dispatch.resolve("linear", dtype, lambda k: takes(k, layer.qkv.weight))
    if bf16 and kernel != "onednn":  # the project's GEMMs where built, else F.linear: no padding
        linears = (layer.qkv, layer.o, layer.gate_up, layer.down, decoder.lm_head)
        assert all(lin.kernel == kernel and lin.plain is None for lin in linears)
        assert decoder.pad_multiple == 0
        if kernel == "torch":
            x = torch.randn(5, layer.qkv.in_features, dtype=dtype)
            assert torch.equal(layer.qkv(x), F.linear(x, layer.qkv.weight))
        return
    assert (layer.o.plain is not None, layer.down.plain is not None) == (bf16, bf16)
    assert layer.qkv.plain is None and layer.gate_up.plain is None and decoder.lm_head.plain is None
    if bf16:
        assert layer.o.plain_from == layer.down.plain_from == PLAIN_FROM_ROWS
    seen: list[int] = []
    call = Linear.__call__

    def record(self, x):
        seen.append(x.shape[0])
        return call(self, x)

    monkeypatch.setattr(Linear, "__call__", record)  # observes the real calls
    decoder.warm_up(max_tokens=100, max_samples=8)
    if not decoder.pad_multiple:  # fp32 through MKL or the project's GEMM: no per-count compile
        assert dtype == torch.float32 and not layer.qkv.onednn and seen == []
        return
    counts = sorted({padded_tokens(t, decoder.pad_multiple) for t in range(1, 101)})
    assert sorted(set(seen)) == sorted(set(counts) | set(range(1, 9)))
    assert all(seen.count(m) >= 4 for m in counts)  # qkv, o, gate_up, down at each


@pytest.mark.parametrize("variant", FP32_GEMM)
def test_fp32_project_gemm_is_exact_to_rounding_and_batch_invariant(variant):
    """`orcaserve::linear_packed` over its panels (24 columns, 48 on AVX-512): float64's answer to
    fp32 rounding for widths that leave a partial last panel and row counts that need every tile
    height (1-4 rows, 1-8 on AVX-512), with and without bias, from non-contiguous inputs too; and
    each row's result bit for bit the same whatever rows it is computed with (every element sums
    its products in one order)."""
    torch.manual_seed(0)
    for out_f, in_f in ((200, 96), (24, 7), (48, 20), (49, 576), (5, 33)):
        weight, bias = torch.randn(out_f, in_f), torch.randn(out_f)
        for b in (bias, None):
            lin = Linear(weight.clone(), b, pack=True, kernel=f"orcaserve.linear_packed.{variant}")
            assert lin.kernel == f"orcaserve.linear_packed.{variant}" and lin.plain is None
            assert lin.weight.shape == (-(-out_f // panel(variant)), in_f, panel(variant))
            batch = torch.randn(70, in_f)
            full = lin(batch)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 31, 32, 33, 39, 70):
                x = batch[:rows]
                want = x.double() @ weight.double().t() + (b.double() if b is not None else 0)
                got = lin(x)
                torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-5)
                assert torch.equal(got, full[:rows]), (out_f, in_f, rows)
            wide = torch.randn(9, in_f + 5)[:, 2 : 2 + in_f]  # row stride != in_features
            torch.testing.assert_close(lin(wide), F.linear(wide, weight, b), atol=1e-4, rtol=1e-5)
    assert lin(torch.empty(0, 33)).shape == (0, 5)
    assert Linear(weight.clone(), None, pack=True, kernel="onednn").kernel == "onednn"
    assert Linear(weight.half(), None, pack=True, kernel=lin.kernel).kernel != lin.kernel  # fp32 and bf16 only


def _assert_bf16_specials(kernel: str) -> None:
    """A bf16 GEMM keeps NaN and infinities, rounds a sum past bf16's range to infinity, and
    answers zero rows with an empty result."""
    ones = Linear(torch.ones(24, 4).bfloat16(), None, pack=True, kernel=kernel)
    assert ones.kernel == kernel
    special = torch.tensor([[float("nan"), 0, 0, 0], [float("-inf"), 0, 0, 0], [3e38, 3e38, 0, 0]]).bfloat16()
    got = ones(special)
    assert got[0].isnan().all() and (got[1] == float("-inf")).all() and (got[2] == float("inf")).all()
    assert ones(torch.empty(0, 4).bfloat16()).shape == (0, 24)


@pytest.mark.parametrize("variant", FP32_GEMM)
def test_bf16_project_gemm_is_the_fp32_sum_rounded_once(variant):
    """bf16 weights run the same fp32 micro-kernel over panels widened on the fly: each result is
    the fp32 op's result on the bf16 values, rounded once to bf16 (to nearest even, as torch
    rounds; NaN and infinities kept), so within half a bf16 ulp of float64's answer; each row bit
    for bit the same in any batch."""
    kernel = f"orcaserve.linear_packed.{variant}"
    torch.manual_seed(0)
    for out_f, in_f in ((200, 96), (49, 576), (5, 33)):
        weight, bias = torch.randn(out_f, in_f).bfloat16(), torch.randn(out_f).bfloat16()
        wide = Linear(weight.float(), bias.float(), pack=True, kernel=kernel)
        for b in (bias, None):
            lin = Linear(weight.clone(), b, pack=True, kernel=kernel)
            assert lin.kernel == kernel and lin.weight.dtype == torch.bfloat16
            assert lin.weight.shape == (-(-out_f // panel(variant)), in_f, panel(variant))
            batch = torch.randn(70, in_f).bfloat16()
            full = lin(batch)
            assert full.dtype == torch.bfloat16
            if b is not None:
                assert torch.equal(full, wide(batch.float()).bfloat16())
            want = batch.double() @ weight.double().t() + (b.double() if b is not None else 0)
            torch.testing.assert_close(full.double(), want, atol=1e-3, rtol=2**-8)
            for rows in (1, 3, 4, 5, 7, 8, 9, 17, 33):
                assert torch.equal(lin(batch[:rows]), full[:rows]), (out_f, in_f, rows)
            strided = torch.randn(9, in_f + 5).bfloat16()[:, 2 : 2 + in_f]  # row stride != in_features
            transposed = torch.randn(in_f, 7).bfloat16().t()  # column stride != 1
            for x in (strided, transposed):
                assert torch.equal(lin(x), lin(x.contiguous()))
    _assert_bf16_specials(kernel)


@pytest.mark.skipif(not BF16_GEMM, reason="the vdpbf16ps GEMM needs AVX-512 BF16")
@pytest.mark.parametrize("variant", BF16_GEMM)
def test_bf16_vdpbf16ps_gemm_is_exact_to_rounding_and_batch_invariant(variant):
    """`orcaserve::linear_packed_bf16` over 48-column pair panels: float64's answer to fp32 sums
    rounded once to bf16, for widths that leave a partial last panel and row counts that need every
    tile height of 1-8, with and without bias, from non-contiguous inputs too; each row bit for bit
    the same in any batch; odd input widths (the pairs) left to the other paths."""
    kernel = f"orcaserve.linear_packed_bf16.{variant}"
    torch.manual_seed(0)
    for out_f, in_f in ((200, 96), (49, 576), (5, 34), (96, 1536)):
        weight, bias = torch.randn(out_f, in_f).bfloat16(), torch.randn(out_f).bfloat16()
        for b in (bias, None):
            lin = Linear(weight.clone(), b, pack=True, kernel=kernel)
            assert lin.kernel == kernel and lin.plain is None
            assert lin.weight.shape == (-(-out_f // 48), in_f // 2, 48, 2)
            batch = torch.randn(70, in_f).bfloat16()
            full = lin(batch)
            assert full.dtype == torch.bfloat16 and full.shape == (70, out_f)
            want = batch.double() @ weight.double().t() + (b.double() if b is not None else 0)
            torch.testing.assert_close(full.double(), want, atol=1e-3 * in_f**0.5, rtol=2**-7)
            for rows in (*range(1, 18), 23, 31, 32, 33, 64):
                assert torch.equal(lin(batch[:rows]), full[:rows]), (out_f, in_f, rows)
            strided = torch.randn(9, in_f + 5).bfloat16()[:, 3 : 3 + in_f]  # odd row stride and offset
            transposed = torch.randn(in_f, 7).bfloat16().t()  # column stride != 1
            for x in (strided, transposed):
                assert torch.equal(lin(x), lin(x.contiguous()))
    _assert_bf16_specials(kernel)
    assert Linear(torch.randn(8, 33).bfloat16(), None, pack=True, kernel=kernel).kernel != kernel  # odd width
    assert Linear(torch.randn(8, 34), None, pack=True, kernel=kernel).kernel != kernel  # bf16 only


GEMV_KERNELS = [
    *(pytest.param(f"orcaserve.linear_packed.{v.values[0]}", torch.float32, id=f"fp32-{v.id}") for v in FP32_GEMM),
    *(pytest.param(f"orcaserve.linear_packed.{v.values[0]}", torch.bfloat16, id=f"bf16-{v.id}") for v in FP32_GEMM),
    *(pytest.param(f"orcaserve.linear_packed_bf16.{v.values[0]}", torch.bfloat16, id=f"dot-{v.id}") for v in BF16_GEMM),
]


@pytest.mark.parametrize(("kernel", "dtype"), GEMV_KERNELS)
def test_gemv_shaped_calls_give_the_batch_bits_on_any_thread_count(kernel, dtype):
    """Up to GEMV_ROWS rows the project's GEMMs walk each thread's share of the panels as one stream
    (gemm/panels.h), bf16 panels widened in registers: each row bit for bit what the batch path
    (GEMV_ROWS + 1 rows and more) gives it, on one thread and on several (ranges of many panels, a
    partial last one), with and without bias."""
    torch.manual_seed(0)
    out_f, in_f = 48 * 37 + 5, 96
    weight, bias = torch.randn(out_f, in_f).to(dtype), torch.randn(out_f).to(dtype)
    threads = torch.get_num_threads()
    for b in (bias, None):
        lin = Linear(weight.clone(), b, pack=True, kernel=kernel)
        assert lin.kernel == kernel and lin.gemv_kernel == kernel
        batch = torch.randn(GEMV_ROWS + 3, in_f).to(dtype)
        full = lin(batch)
        want = batch.double() @ weight.double().t() + (b.double() if b is not None else 0)
        torch.testing.assert_close(full.double(), want, atol=1e-3 * in_f**0.5, rtol=2**-7)
        try:
            for n in sorted({1, 2, 3, threads}):
                torch.set_num_threads(n)
                for rows in range(1, GEMV_ROWS + 1):
                    assert torch.equal(lin(batch[:rows]), full[:rows]), (n, rows)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemv_rows_run_the_tables_gemv_kernel(dtype):
    """A layer runs calls of up to GEMV_ROWS rows with the dispatch table's `linear_gemv` choice:
    where that is another GEMM than the `linear` row's (AMX: oneDNN for larger steps) from a second
    copy packed for it, each path giving exactly what it gives alone; elsewhere from the one copy.
    A forced kernel, or gemv=False, keeps one path."""
    torch.manual_seed(0)
    weight, bias = torch.randn(100, 96).to(dtype), torch.randn(100).to(dtype)
    lin = Linear(weight, bias, pack=True)
    chosen = dispatch.resolve("linear_gemv", dtype, lambda k: takes(k, weight))
    if dtype == torch.bfloat16 and chosen.startswith("orcaserve.") and chosen != lin.kernel:
        assert lin.gemv_kernel == chosen and lin.gemv_weight is not None
        alone = Linear(weight, bias, pack=True, kernel=chosen)
        main = Linear(weight, bias, pack=True, kernel=lin.kernel)
        for rows in (1, 2, GEMV_ROWS, GEMV_ROWS + 1, 9):
            x = torch.randn(rows, 96).to(dtype)
            assert torch.equal(lin(x), (alone if rows <= GEMV_ROWS else main)(x)), rows
    else:
        assert lin.gemv_kernel == lin.kernel and lin.gemv_weight is None
    assert Linear(weight, bias, pack=True, gemv=False).gemv_weight is None
    assert Linear(weight, bias, pack=True, kernel="torch").gemv_weight is None

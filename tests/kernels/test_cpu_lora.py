"""The C++ LoRA operators (kernels/cpu/csrc/gemm/lora.cpp, every ISA variant this machine executes)
held to their PyTorch twins (kernels/pytorch/lora.py) through the dispatch table's cells
(kernels/cpu/lora.py): ranks 1-64, widths that are not a multiple of the vector width, empty
groups, gathered rows, a column slice of a fused output, adapters absent from the step; rows of no
adapter and pad rows left bit for bit. Skipped if the library cannot be built."""

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params

from orcaserve.kernels import dispatch
from orcaserve.kernels.cpu.lora import batched_cell, sgmv_cell
from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, lora_batched, lora_sgmv

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    # fp32: other summation orders than the GEMMs'; bf16: an intermediate (h, the expand, the
    # scaled delta) may round to the neighbouring bf16 value where the fp32 sums differ
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("variant", params("lora_sgmv"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 3, 16, 64])
def test_sgmv_equals_the_twin(variant, dtype, rank):
    gen = torch.Generator().manual_seed(rank)
    t, d_in, width, first = 29, 37, 53, 11  # y: columns [11, 64) of a fused output 70 wide

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    x, y = rand(t, d_in), rand(t, 70)
    groups = [
        LoraGroup(slice(2, 9), rand(rank, d_in, s=0.3), rand(width, rank, s=0.3), 2.0),
        LoraGroup(torch.tensor([0, 12, 13, 27]), rand(rank, d_in, s=0.3), rand(width, rank, s=0.3), 0.25),
        LoraGroup(torch.tensor([], dtype=torch.int64), rand(rank, d_in), rand(width, rank), 1.0),  # empty
        LoraGroup(slice(20, 20), rand(rank, d_in), rand(width, rank), 1.0),  # empty run
    ]
    want, got = y.clone(), y.clone()
    lora_sgmv(want[:, first : first + width], x, groups)
    sgmv_cell(op("lora_sgmv", variant))(got[:, first : first + width], x, groups)
    torch.testing.assert_close(got, want, **_tol(dtype))
    untouched = [r for r in range(t) if r not in (*range(2, 9), 0, 12, 13, 27)]
    assert torch.equal(got[untouched], y[untouched])
    assert torch.equal(got[:, :first], y[:, :first]) and torch.equal(got[:, first + width :], y[:, first + width :])


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 5, 16, 64])
@pytest.mark.parametrize("present", [(0, 1, 2, 3, 4), (1, 3), (4,)])
def test_batched_equals_the_twin(variant, dtype, rank, present):
    """Five slots stacked at rank `rank`: slot 0 at its full rank, slot 1 below it (zero-padded),
    slot 2 not targeting the projection (zeros), slot 3 free of rows in some steps; only the
    slots in `present` have rows; 4 pad rows after the step's rows."""
    gen = torch.Generator().manual_seed(rank * 7 + len(present))
    t, d_in, d_out, slots = 41, 45, 39, 5
    own = (rank, max(1, rank // 2), 0, rank, 1)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    x, y = rand(t + 4, d_in), rand(t + 4, d_out)
    a_all, b_all = torch.zeros(slots, rank, d_in, dtype=dtype), torch.zeros(d_out, slots, rank, dtype=dtype)
    for s, r in enumerate(own):
        a_all[s, :r], b_all[:, s, :r] = rand(r, d_in), rand(d_out, r)
    scales = [2.0, 0.5, 1.0, 0.125, 4.0]
    row_slot = [present[i % len(present)] if i % 3 else -1 for i in range(t)]  # every third row: base
    batch = LoraBatch.of(row_slot, slots, rank, scales, dtype)
    a, b = a_all.view(slots * rank, d_in), b_all.view(d_out, slots * rank)
    want, got = y.clone(), y.clone()
    lora_batched(want, x, batch, a, b)
    batched_cell(op("lora_batched", variant))(got, x, batch, a, b)
    torch.testing.assert_close(got, want, **_tol(dtype))
    untouched = [r for r in range(t + 4) if r >= t or row_slot[r] < 0]
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("name", ["lora_sgmv", "lora_batched"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_table_names_the_cpp_operator_where_it_was_measured_faster(name, dtype):
    assert dispatch.choice(name, dtype, "avx2").runs == f"orcaserve.{name}.avx2"
    for cap in ("generic", "avx512", "avx512_bf16", "amx"):  # not measured there: the twin
        assert dispatch.choice(name, dtype, cap).runs == "torch"

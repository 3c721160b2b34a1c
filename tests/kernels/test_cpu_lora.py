"""The C++ LoRA operators (kernels/cpu/csrc/gemm/lora.cpp, every ISA variant this machine executes)
held to their PyTorch twins (kernels/pytorch/lora.py) through the dispatch table's cells
(kernels/cpu/lora.py): ranks 1-64, widths that are not a multiple of the vector width (nor of
vdpbf16ps' 32 values), empty groups, gathered rows, a column slice of a fused output, adapters
absent from the step, B stacked transposed (as `LoraSet` keeps it) or in PEFT's layout, more rows
of one adapter than a task holds; rows of no adapter and pad rows left bit for bit. Skipped if the
library cannot be built."""

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
@pytest.mark.parametrize("transposed", [False, True], ids=["peft", "bt"])
def test_sgmv_equals_the_twin(variant, dtype, rank, transposed):
    gen = torch.Generator().manual_seed(rank)
    t, d_in, width, first = 29, 37, 53, 11  # y: columns [11, 64) of a fused output 70 wide

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    def rand_b():  # B [width, rank]: PEFT's layout, or a view of B^T's storage
        return rand(rank, width, s=0.3).t() if transposed else rand(width, rank, s=0.3)

    x, y = rand(t, d_in), rand(t, 70)
    groups = [
        LoraGroup(slice(2, 9), rand(rank, d_in, s=0.3), rand_b(), 2.0),
        LoraGroup(torch.tensor([0, 12, 13, 27]), rand(rank, d_in, s=0.3), rand_b(), 0.25),
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


def _stacks(slots, rank, d_in, d_out, dtype, transposed):
    """Zero stacks A [S, R, in] and B [out, S, R]: B over B^T's storage [S, R, out] as `LoraSet`
    keeps it (scheduler/lora/resident.py), or contiguous as PEFT's B."""
    a_all = torch.zeros(slots, rank, d_in, dtype=dtype)
    if transposed:
        return a_all, torch.zeros(slots, rank, d_out, dtype=dtype).permute(2, 0, 1)
    return a_all, torch.zeros(d_out, slots, rank, dtype=dtype)


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 5, 16, 64])
@pytest.mark.parametrize("present", [(0, 1, 2, 3, 4), (1, 3), (4,)])
@pytest.mark.parametrize("transposed", [True, False], ids=["bt", "peft"])
def test_batched_equals_the_twin(variant, dtype, rank, present, transposed):
    """Five slots stacked at rank `rank`: slot 0 at its full rank, slot 1 below it (zero-padded),
    slot 2 not targeting the projection (zeros), slot 3 free of rows in some steps; only the
    slots in `present` have rows (one slot alone: 27 rows, more than a task's 16); 4 pad rows
    after the step's rows."""
    gen = torch.Generator().manual_seed(rank * 7 + len(present))
    t, d_in, d_out, slots = 41, 45, 39, 5
    own = (rank, max(1, rank // 2), 0, rank, 1)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    x, y = rand(t + 4, d_in), rand(t + 4, d_out)
    a_all, b_all = _stacks(slots, rank, d_in, d_out, dtype, transposed)
    for s, r in enumerate(own):
        a_all[s, :r], b_all[:, s, :r] = rand(r, d_in), rand(d_out, r)
    scales = [2.0, 0.5, 1.0, 0.125, 4.0]
    row_slot = [present[i % len(present)] if i % 3 else -1 for i in range(t)]  # every third row: base
    batch = LoraBatch.of(row_slot, slots, rank, scales, dtype)
    a, b = a_all.view(slots * rank, d_in), b_all.view(d_out, slots * rank)
    want, got = y.clone(), y.clone()
    batched_cell(op("lora_batched", variant))(got, x, batch, a, b)
    assert "mask" not in vars(batch) and "scale" not in vars(batch)  # the twin's, never built for the C++ cell
    lora_batched(want, x, batch, a, b)
    torch.testing.assert_close(got, want, **_tol(dtype))
    untouched = [r for r in range(t + 4) if r >= t or row_slot[r] < 0]
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("d_in", "d_out"), [(5, 3), (31, 33), (97, 65), (1539, 70)])
@pytest.mark.parametrize("per_slot", [1, 2, 3, 5, 7, 17])
def test_batched_odd_widths_and_row_counts(variant, dtype, d_in, d_out, per_slot):
    """Widths below, across and far past a vector (and vdpbf16ps' 32 values: 1539 = 48 x 32 + 3),
    `per_slot` rows of each of three adapters (the register blocks of 4 rows and their remainders,
    a task's 16 and one more), interleaved with base rows; then a step of base rows alone."""
    gen = torch.Generator().manual_seed(d_in * 31 + per_slot)
    slots, rank = 3, 16

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    row_slot = [s if k % 2 else -1 for i in range(per_slot) for s in range(slots) for k in (0, 1)]
    t = len(row_slot)
    x, y = rand(t, d_in), rand(t, d_out)
    a_all, b_all = _stacks(slots, rank, d_in, d_out, dtype, True)
    a_all[:], b_all[:] = rand(slots, rank, d_in), rand(d_out, slots, rank)
    a, b = a_all.view(slots * rank, d_in), b_all.view(d_out, slots * rank)
    cell = batched_cell(op("lora_batched", variant))
    for rows in (row_slot, [-1] * t):
        batch = LoraBatch.of(rows, slots, rank, [0.5, 2.0, 1.0], dtype)
        want, got = y.clone(), y.clone()
        cell(got, x, batch, a, b)
        lora_batched(want, x, batch, a, b)
        torch.testing.assert_close(got, want, **_tol(dtype))
        assert torch.equal(got[[r for r in range(t) if rows[r] < 0]], y[[r for r in range(t) if rows[r] < 0]])


@pytest.mark.parametrize("name", ["lora_sgmv", "lora_batched"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_table_names_the_cpp_operator_where_it_was_measured_faster(name, dtype):
    for cap in ("avx2", "avx512", "avx512_bf16", "amx"):  # amx: avx512_bf16's code, unmeasured there
        assert dispatch.choice(name, dtype, cap).runs == f"orcaserve.{name}.{cap}"
    assert dispatch.choice(name, dtype, "generic").runs == "torch"  # no C++ variant below avx2


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_roundings_are_the_twins_bit_for_bit(variant, dtype):
    """Rank 1 and one-hot rows: every sum is a single exact product, so only the roundings (the
    shrink, the expand, the scale, the add; nearest even) decide, and the C++ result must be the
    twin's bit for bit, deltas in fp32's denormal range (vcvtneps2bf16 would read them as zero:
    avx512_bf16 rounds those lanes in software) and overflow to infinity included."""
    gen = torch.Generator().manual_seed(5)
    t, d_in, d_out, slots = 40, 70, 67, 4
    x = torch.zeros(t, d_in, dtype=dtype)
    x[torch.arange(t), torch.randint(0, d_in, (t,), generator=gen)] = 1.0
    a = (torch.randn(slots, d_in, generator=gen) * 3).to(dtype)
    b = (torch.randn(slots, d_out, generator=gen) * 3).to(dtype).t()  # B^T's storage, as stacked
    y = torch.randn(t, d_out, generator=gen).to(dtype)
    y[::5] *= 1e-37  # tiny outputs: their sums with tiny deltas near the denormal range
    scales = [1e-39, 3.3e-38, 0.7071, 3e38]  # denormal deltas, near FLT_MIN, ordinary, overflow
    batch = LoraBatch.of([i % (slots + 1) - 1 for i in range(t)], slots, 1, scales, dtype)
    want, got = y.clone(), y.clone()
    batched_cell(op("lora_batched", variant))(got, x, batch, a, b)
    lora_batched(want, x, batch, a, b)
    assert torch.equal(got, want)

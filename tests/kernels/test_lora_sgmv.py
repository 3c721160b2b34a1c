"""The segmented LoRA update (kernels/pytorch/lora.py), the dispatch table's `lora_sgmv`: each
group's rows get PEFT's update, rows of no group are left bit for bit as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orcaserve.kernels.pytorch.lora import LoraBatch, LoraGroup, lora_batched, lora_sgmv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_gets_its_adapters_update_and_other_rows_nothing(dtype):
    gen = torch.Generator().manual_seed(0)
    t, d_in, d_out = 23, 32, 48

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, y = rand(t, d_in), rand(t, d_out)
    adapters = [(rand(8, d_in), rand(d_out, 8), 2.0), (rand(4, d_in), rand(d_out, 4), 0.5)]
    gathered = torch.tensor([1, 2, 9, 10, 11, 20])
    groups = [LoraGroup(slice(3, 8), *adapters[0]), LoraGroup(gathered, *adapters[1])]
    out = y.clone()
    lora_sgmv(out, x, groups)
    want = y.clone()
    for rows, (a, b, scale) in [(list(range(3, 8)), adapters[0]), (gathered.tolist(), adapters[1])]:
        for r in rows:  # one row at a time, as PEFT's layer computes it: base + B(A(x)) * scale
            want[r] = want[r] + F.linear(F.linear(x[r : r + 1], a), b)[0] * scale
    touched = set(range(3, 8)) | set(gathered.tolist())
    untouched = [r for r in range(t) if r not in touched]
    assert torch.equal(out[untouched], y[untouched])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_a_column_slice_of_a_fused_output_is_updated_in_place():
    x, y = torch.randn(6, 8), torch.zeros(6, 30)
    a, b = torch.randn(2, 8), torch.randn(10, 2)
    lora_sgmv(y[:, 10:20], x, [LoraGroup(slice(0, 6), a, b, 1.0)])
    assert torch.equal(y[:, :10], torch.zeros(6, 10)) and torch.equal(y[:, 20:], torch.zeros(6, 10))
    torch.testing.assert_close(y[:, 10:20], x @ a.T @ b.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("present", [(0, 1, 2, 3), (1, 3)])
def test_the_batched_update_equals_one_gemm_pair_per_adapter(dtype, present):
    """`lora_batched` (several adapters in one step) against `lora_sgmv` over the same groups:
    ranks padded with zeros, a slot that does not target the projection adds nothing, only the
    adapters present read, rows of no adapter and pad rows untouched."""
    gen = torch.Generator().manual_seed(1)
    t, d_in, d_out, ranks = 19, 32, 40, (8, 4, 0, 8)  # slot 2 does not target this projection

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, y = rand(t + 3, d_in), rand(t + 3, d_out)  # 3 pad rows past the step's t
    weights = [(rand(r, d_in), rand(d_out, r)) if r else None for r in ranks]
    scales = [2.0, 0.5, 1.0, 0.7071]
    a_all, b_all = torch.zeros(4, 8, d_in, dtype=dtype), torch.zeros(d_out, 4, 8, dtype=dtype)
    for s, w in enumerate(weights):
        if w is not None:
            a_all[s, : w[0].shape[0]], b_all[:, s, : w[1].shape[1]] = w
    rows = {0: [0, 1, 2, 7], 1: [4, 5], 2: [6], 3: [10, 11, 12, 13, 18]}
    groups = {s: rows[s] for s in present}
    row_slot = [next((s for s, r in groups.items() if i in r), -1) for i in range(t)]
    out = y.clone()
    batch = LoraBatch.of(row_slot, 4, 8, scales, dtype)
    assert batch.every == (present == (0, 1, 2, 3))
    lora_batched(out, x, batch, a_all.view(32, d_in), b_all.view(d_out, 32))
    want = y.clone()
    lora_sgmv(
        want,
        x,
        [LoraGroup(torch.tensor(r), *weights[s], scales[s]) for s, r in groups.items() if weights[s] is not None],
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: the GEMMs of S R and r columns block their sums apart
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    untouched = [r for r in range(t + 3) if all(r not in g for g in groups.values())]
    assert torch.equal(out[untouched], y[untouched])

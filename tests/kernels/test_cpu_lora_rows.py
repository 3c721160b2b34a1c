"""The batched LoRA update over many rows of one adapter (a prefill step's shape; docs/lora.md "The
segmented update in the dispatch table"): the C++ operator (kernels/cpu/csrc/gemm/lora.cpp) takes a
task's rows in register blocks (of up to 8 rows in the `vdpbf16ps` expand), and each row's sums run
in the same order whatever block it falls in, so one call over T rows is bit for bit each row's own
call, and the twin's result (kernels/pytorch/lora.py) within the dtype's tolerance. Odd row counts,
ranks 8, 16 and 64, a fused q/k/v output's column ranges, the standard stacks and (avx512_bf16, amx)
the blocked ones. Skipped if the library cannot be built."""

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params

from orcaserve.kernels.cpu.lora import block_a, block_b, blocked, parts_cell
from orcaserve.kernels.pytorch.lora import LoraBatch, lora_batched_parts

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)


def _tol(dtype):  # as test_cpu_lora.py: another order of the fp32 sums, a bf16 intermediate's neighbour
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize(("t", "d_in", "widths"), [(67, 70, (70, 33, 33)), (45, 576, (576, 192, 192))])
def test_many_rows_of_one_adapter_are_each_rows_own_call(variant, dtype, rank, t, d_in, widths):
    gen = torch.Generator().manual_seed(rank + t)

    def rand(*shape, std=0.05):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    slots, first, parts, peft = 2, 0, [], []  # slot 0 empty, slot 1 the adapter
    for w in widths:
        a, b = rand(rank, d_in), rand(w, rank)
        stack_a = torch.cat([torch.zeros_like(a), a])  # [S R, in]
        stack_b = torch.cat([torch.zeros_like(b.t()), b.t()]).t()  # [out, S R] over B^T's storage
        parts.append((first, first + w, stack_a, stack_b))
        peft.append((first, first + w, a, b))
        first += w
    cell = op("lora_batched", variant)
    run = parts_cell(cell)
    blk = parts
    if blocked(cell, dtype):
        zero_a, zero_b = torch.zeros(rank, d_in, dtype=dtype), torch.zeros(1, rank, dtype=dtype)
        blk = [(f, last, torch.stack([block_a(zero_a, rank), block_a(a, rank)]),
                torch.stack([block_b(zero_b.expand(last - f, rank), rank), block_b(b, rank)]))
               for f, last, a, b in peft]  # fmt: skip
    slot = [-1 if i % 9 == 4 else 1 for i in range(t)]  # rows of no adapter among them
    x = rand(t + 2, d_in, std=1.0)  # 2 pad rows past the batch
    y = torch.randn(t + 2, first, generator=gen).to(dtype)
    scales = [0.5, 2.0]
    got, twin = y.clone(), y.clone()
    run(got, x, LoraBatch.of(slot, slots, rank, scales, dtype), blk)
    lora_batched_parts(twin, x, LoraBatch.of(slot, slots, rank, scales, dtype), parts)
    for i in range(t):
        one = y.clone()
        run(one, x, LoraBatch.of([s if k == i else -1 for k, s in enumerate(slot)], slots, rank, scales, dtype), blk)
        assert torch.equal(got[i], one[i]), f"row {i}"
    assert torch.equal(got[t:], y[t:]) and torch.equal(got[4:t:9], y[4:t:9])  # pad rows, rows of no adapter
    assert not torch.equal(got[:4], y[:4])
    torch.testing.assert_close(got, twin, **_tol(dtype))

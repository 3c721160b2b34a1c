"""The segmented LoRA update in Triton (kernels/triton/lora.py) against the PyTorch twins
(kernels/pytorch/lora.py): run by Triton's CPU interpreter (or compiled on a GPU with
ORCASERVE_TEST_DEVICE=cuda). fp32 and fp16 only: the interpreter computes bf16 wrongly.

As tests/kernels/test_triton_ternary.py, on the CPU the cases run in one child process with
TRITON_INTERPRET=1 (`python tests/kernels/test_triton_lora.py`) that prints, per case, the largest
difference from the twin relative to the update's own size, and whether every row of no adapter
and every column outside the projection's range is bit for bit untouched. The contract
(docs/lora.md "The Triton kernels"): the twin's result within fp32 accumulation (fp32) or one
rounding of the dtype (fp16), since tl.dot sums in another order than the twin's GEMMs.
"""

import json
import os

import pytest
from interpreted import child_outcomes

DEVICE = os.environ.get("ORCASERVE_TEST_DEVICE", "cpu")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}  # max |got - twin| / max |update|
# SmolLM2's q/k/v widths (576 | 192 | 192), and odd widths: in 200, out 7 + 130 + 33
FUSED = {"smollm2": (576, (576, 192, 192)), "odd": (200, (7, 130, 33))}
RANKS = (8, 16, 64)


def _cases() -> dict[str, list]:
    from functools import partial

    import torch

    from orcaserve.kernels.pytorch import lora as twin
    from orcaserve.kernels.triton import lora as tri

    g = torch.Generator().manual_seed(0)
    out: dict[str, list] = {}

    def check(name, dtype, run_twin, run_tri, y0, touched_rows, cols):
        want, got = y0.clone(), y0.clone().to(DEVICE)
        run_twin(want[:, cols[0] : cols[1]])
        run_tri(got[:, cols[0] : cols[1]])
        got = got.cpu()
        rows = torch.tensor(sorted(touched_rows), dtype=torch.int64)
        span = (want - y0).float()[rows][:, cols[0] : cols[1]].abs().max().item() if len(rows) else 0.0
        err = (got.float() - want.float()).abs().max().item()
        keep = torch.ones_like(y0, dtype=torch.bool)
        keep[rows.unsqueeze(1), torch.arange(cols[0], cols[1]).unsqueeze(0)] = False
        untouched = torch.equal(got[keep], y0[keep])
        out[f"{name} {str(dtype).removeprefix('torch.')}"] = [err / max(span, 1e-30), untouched, err]

    def check_parts(name, dtype, run_tri, x, batch, parts, y0):
        """`run_tri` (a `lora_batched_parts`) against the twin's, every projection of `parts`."""
        dev = [(f, last, a.to(DEVICE), b.to(DEVICE)) for f, last, a, b in parts]
        touched = [i for i, s in enumerate(batch.slot_of) if s >= 0]
        twin_run = partial(twin.lora_batched_parts, x=x, batch=batch, parts=parts)
        tri_run = partial(run_tri, x=x.to(DEVICE), batch=batch, parts=dev)
        check(name, dtype, twin_run, tri_run, y0, touched, (0, parts[-1][1]))

    def rnd(*shape, dtype):
        return (torch.randn(*shape, generator=g) * 0.5).to(dtype)

    for dtype in (torch.float32, torch.float16):
        for label, (d_in, widths) in FUSED.items():
            out_w = sum(widths)
            for rank in RANKS:
                # lora_batched: 4 slots stacked at `rank`, slot 2 empty (zeros), slot 1 at rank // 2;
                # rows of slots 0, 1, 3 interleaved with rows of no adapter (-1) and 3 pad rows after.
                t, slots = 21, 4
                slot_of = [0, 0, -1, 1, 3, 3, 3, -1, 1, 0, -1, 3, 1, 1, 0, -1, 3, 0, 0, 1, -1]
                x = rnd(t + 3, d_in, dtype=dtype)
                y0 = rnd(t + 3, out_w, dtype=dtype)
                scales = [0.5, 2.0, 1.0, 0.25]
                batch = twin.LoraBatch.of(slot_of, slots, rank, scales, dtype)
                parts = []
                col = 0
                for w in widths:
                    a = rnd(slots, rank, d_in, dtype=dtype)
                    b_t = rnd(slots, rank, w, dtype=dtype)  # B^T storage, as the resident stacks
                    a[2], b_t[2] = 0, 0
                    a[1, rank // 2 :], b_t[1, rank // 2 :] = 0, 0
                    parts.append((col, col + w, a.view(-1, d_in), b_t.view(-1, w).t()))
                    col += w
                touched = [i for i, s in enumerate(slot_of) if s >= 0]
                check_parts(f"batched {label} r{rank}", dtype, tri.lora_batched_parts, x, batch, parts, y0)
                # one projection alone (the k slice): the other columns untouched
                f, last, a, b = parts[1]
                check(
                    f"batched {label} r{rank} k only",
                    dtype,
                    partial(twin.lora_batched, x=x, batch=batch, a=a, b=b),
                    partial(tri.lora_batched, x=x.to(DEVICE), batch=batch, a=a.to(DEVICE), b=b.to(DEVICE)),
                    y0,
                    touched,
                    (f, last),
                )
            # lora_sgmv: two adapters (ranks 8 and 16), a contiguous run, gathered rows, an empty group
            w = widths[0]
            a8, b8 = rnd(8, d_in, dtype=dtype), rnd(w, 8, dtype=dtype)
            a16, b16 = rnd(16, d_in, dtype=dtype), rnd(w, 16, dtype=dtype)
            x = rnd(40, d_in, dtype=dtype)
            y0 = rnd(40, w, dtype=dtype)
            gathered = torch.tensor([20, 22, 25, 39])
            for name, groups in (
                ("one adapter", [twin.LoraGroup(slice(3, 21), a8, b8, 2.0)]),
                (
                    "two adapters",
                    [
                        twin.LoraGroup(slice(0, 17), a8, b8, 2.0),
                        twin.LoraGroup(gathered, a16, b16, 0.125),
                        twin.LoraGroup(slice(30, 30), a16, b16, 0.125),
                    ],
                ),
            ):
                on_dev = [
                    twin.LoraGroup(
                        gr.rows if isinstance(gr.rows, slice) else gr.rows.to(DEVICE),
                        gr.a.to(DEVICE),
                        gr.b.to(DEVICE),
                        gr.scale,
                    )
                    for gr in groups
                ]
                touched = [
                    r
                    for gr in groups
                    for r in (range(gr.rows.start, gr.rows.stop) if isinstance(gr.rows, slice) else gr.rows.tolist())
                ]
                check(
                    f"sgmv {label} {name}",
                    dtype,
                    partial(twin.lora_sgmv, x=x, groups=groups),
                    partial(tri.lora_sgmv, x=x.to(DEVICE), groups=on_dev),
                    y0,
                    touched,
                    (0, w),
                )
        # a step whose rows name no adapter: nothing launched, y untouched
        y0 = rnd(5, 64, dtype=dtype)
        y = y0.clone().to(DEVICE)
        empty = twin.LoraBatch.of([-1] * 5, 2, 16, [1.0, 1.0], dtype)
        tri.lora_batched(
            y, rnd(5, 32, dtype=dtype).to(DEVICE), empty, rnd(32, 32, dtype=dtype), rnd(64, 32, dtype=dtype)
        )
        out[f"no adapter rows {str(dtype).removeprefix('torch.')}"] = [0.0, torch.equal(y.cpu(), y0), 0.0]
        _cells(check, check_parts, rnd, dtype, out)
    return out


def _cells(check, check_parts, rnd, dtype, out) -> None:
    """The engine's cells (kernels/triton/lora_cells.py): two steps' batches and a one-adapter
    step through descriptors and scratch allocated once, each the twin's; the buffers kept."""
    from functools import partial

    import torch

    from orcaserve.kernels.pytorch import lora as twin
    from orcaserve.kernels.triton.lora_cells import SegmentBuffers, TritonLora

    cells = TritonLora(SegmentBuffers(32, 4, 64, DEVICE))
    ptrs = (cells.buffers.ints.data_ptr(), cells.buffers.scratch.data_ptr())
    d_in, widths = FUSED["odd"]
    for i, slot_of in enumerate(([0, -1, 2, 2, 1, -1, 0], [3, 3, -1, 1, 3])):
        x, y0 = rnd(len(slot_of) + 2, d_in, dtype=dtype), rnd(len(slot_of) + 2, sum(widths), dtype=dtype)
        batch = twin.LoraBatch.of(slot_of, 4, 16, [0.5, 2.0, 1.0, 0.25], dtype)
        parts, col = [], 0
        for w in widths:
            parts.append((col, col + w, rnd(64, d_in, dtype=dtype), rnd(4, 16, w, dtype=dtype).view(-1, w).t()))
            col += w
        check_parts(f"cells batched {i}", dtype, cells.parts, x, batch, parts, y0)
    a, b, rows = rnd(8, d_in, dtype=dtype), rnd(widths[1], 8, dtype=dtype), torch.tensor([1, 4, 5])
    x, y0 = rnd(7, d_in, dtype=dtype), rnd(7, widths[1], dtype=dtype)
    check(
        "cells sgmv",
        dtype,
        partial(twin.lora_sgmv, x=x, groups=[twin.LoraGroup(rows, a, b, 2.0)]),
        partial(cells.sgmv, x=x.to(DEVICE), groups=[twin.LoraGroup(rows.to(DEVICE), a.to(DEVICE), b.to(DEVICE), 2.0)]),
        y0,
        rows.tolist(),
        (0, widths[1]),
    )
    kept = ptrs == (cells.buffers.ints.data_ptr(), cells.buffers.scratch.data_ptr()) and cells.buffers.uploads == 3
    out[f"cells buffers kept {str(dtype).removeprefix('torch.')}"] = [0.0, kept, 0.0]


def _names() -> list[str]:
    names = []
    for dt in TOLERANCE:
        for label in FUSED:
            for r in RANKS:
                names += [f"batched {label} r{r} {dt}", f"batched {label} r{r} k only {dt}"]
            names += [f"sgmv {label} one adapter {dt}", f"sgmv {label} two adapters {dt}"]
        names.append(f"no adapter rows {dt}")
        names += [f"cells batched 0 {dt}", f"cells batched 1 {dt}", f"cells sgmv {dt}", f"cells buffers kept {dt}"]
    return names


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list]:
    return _cases() if DEVICE != "cpu" else child_outcomes(__file__, timeout=900)


@pytest.mark.slow  # the Triton interpreter in a child process; the full suite runs it
@pytest.mark.parametrize("case", _names())
def test_triton_lora_matches_the_twin(outcomes, case):
    rel, untouched, err = outcomes[case]
    assert untouched, f"{case}: a row of no adapter or a column outside the range changed"
    assert rel <= TOLERANCE[case.rsplit(" ", 1)[1]], f"{case}: max error {err} ({rel:.2e} of the update)"


def test_rank_pad_is_a_dot_side():
    from orcaserve.kernels.triton.lora import rank_pad

    assert [rank_pad(r) for r in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]


def test_the_cuda_cells_are_the_triton_kernels():
    import torch

    from orcaserve.kernels.cpu.lora import batched_for, sgmv_for
    from orcaserve.kernels.triton import lora

    assert sgmv_for(torch.bfloat16, "cuda") is lora.lora_sgmv
    assert batched_for(torch.bfloat16, torch.device("cuda", 0)) == (lora.lora_batched_parts, False)


if __name__ == "__main__":
    print(json.dumps(_cases()))

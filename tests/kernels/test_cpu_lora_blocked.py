"""The batched LoRA update's one call per fused output and its blocked stacks (docs/lora.md "Several
adapters in one step"): the C++ operator (kernels/cpu/csrc/gemm/lora.cpp) over a fused output's
projections at once is bit for bit its calls one projection at a time; over the blocked stacks
(avx512_bf16 and amx in bf16) bit for bit over the standard ones, widths and ranks padded; and a
`LoraSet` holding its stacks blocked, adapters swapped between slots, updates every projection as
the same set in the twin's layout (kernels/pytorch/lora.py) does. Skipped if the library cannot be
built."""

from types import SimpleNamespace

import pytest
import torch
from cpu_variants import LOADED, REASON, op, params, variants

from orcaserve.kernels.cpu.lora import batched_cell, batched_for, block_a, block_b, blocked, blocked_rank, parts_cell
from orcaserve.kernels.pytorch.lora import LoraBatch, lora_batched_parts
from orcaserve.scheduler.lora.adapter import LoraAdapter, ModuleShapes
from orcaserve.scheduler.lora.resident import FUSED, LoraSet

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)
BLOCKED = [v for v in variants("lora_batched") if v in ("avx512_bf16", "amx")]
ATOL, RTOL = 3e-2, 2e-2  # bf16: an intermediate may round to its neighbour (test_cpu_lora.py)


def _rand(gen, *shape, dtype=torch.bfloat16, std=0.05):
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def _parts(gen, slots, rank, d_in, widths, dtype):
    """A fused output's projections as the standard stacks hold them: (first, last, a, b), and each
    slot's PEFT weights (A [r, in], B [out, r]) for the blocked ones."""
    parts, peft, first = [], [], 0
    for w in widths:
        pairs = [(_rand(gen, rank, d_in, dtype=dtype), _rand(gen, w, rank, dtype=dtype)) for _ in range(slots)]
        a = torch.cat([p[0] for p in pairs])  # [S R, in]
        b = torch.cat([p[1].t() for p in pairs]).t()  # [out, S R] over B^T's storage
        parts.append((first, first + w, a, b))
        peft.append(pairs)
        first += w
    return parts, peft


@pytest.mark.parametrize("variant", params("lora_batched"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_call_for_a_fused_output_is_its_projections_one_by_one(variant, dtype):
    gen = torch.Generator().manual_seed(1)
    slots, rank, t, d_in, widths = 5, 8, 41, 70, (70, 33, 33)
    parts, _ = _parts(gen, slots, rank, d_in, widths, dtype)
    x = _rand(gen, t + 3, d_in, dtype=dtype, std=1.0)
    batch = LoraBatch.of([i % (slots + 1) - 1 for i in range(t)], slots, rank, [0.5, 2.0, 1.0, 4.0, 0.25], dtype)
    y = torch.randn(t + 3, sum(widths), generator=gen).to(dtype)  # 3 pad rows past the batch
    one, each = y.clone(), y.clone()
    parts_cell(op("lora_batched", variant))(one, x, batch, parts)
    for first, last, a, b in parts:
        batched_cell(op("lora_batched", variant))(each[:, first:last], x, batch, a, b)
    assert torch.equal(one, each)
    assert torch.equal(one[t:], y[t:]) and torch.equal(one[0:t:6], y[0:t:6])  # pad rows, rows of no adapter


@pytest.mark.parametrize("variant", BLOCKED or [pytest.param("none", marks=pytest.mark.skip("no vdpbf16ps variant"))])
@pytest.mark.parametrize("rank", [1, 6, 16])
@pytest.mark.parametrize("shape", [(70, (70, 33, 33)), (64, (100,)), (576, (576, 192, 192))])
def test_the_blocked_stacks_are_the_standard_ones_bit_for_bit(variant, rank, shape):
    gen = torch.Generator().manual_seed(rank)
    d_in, widths = shape
    slots, t, stacked = 4, 23, blocked_rank(rank)
    parts, peft = _parts(gen, slots, rank, d_in, widths, torch.bfloat16)
    # the standard stacks at the blocked stacks' rank (zeros past the adapters' own), and the blocked
    pad = []
    for (first, last, _, _), pairs in zip(parts, peft):
        a = torch.zeros(slots, stacked, d_in, dtype=torch.bfloat16)
        bt = torch.zeros(slots, stacked, last - first, dtype=torch.bfloat16)
        for s, (sa, sb) in enumerate(pairs):
            a[s, :rank], bt[s, :rank] = sa, sb.t()
        pad.append((first, last, a.view(-1, d_in), bt.view(-1, last - first).t()))
    blk = []
    for (first, last, _, _), pairs in zip(parts, peft):
        a_blk = torch.stack([block_a(sa, stacked) for sa, _ in pairs])
        blk.append((first, last, a_blk, torch.stack([block_b(sb, stacked) for _, sb in pairs])))
    x = _rand(gen, t, d_in, std=1.0)
    batch = LoraBatch.of([i % (slots + 1) - 1 for i in range(t)], slots, stacked, [0.5, 2.0, 1.0, 4.0], torch.bfloat16)
    y = torch.randn(t, sum(widths), generator=gen).to(torch.bfloat16)
    got, want, twin = y.clone(), y.clone(), y.clone()
    cell = parts_cell(op("lora_batched", variant))
    cell(got, x, batch, blk)
    cell(want, x, batch, pad)
    lora_batched_parts(twin, x, batch, pad)
    assert torch.equal(got, want) and not torch.equal(got, y)
    torch.testing.assert_close(got, twin, atol=ATOL, rtol=RTOL)


def _adapter(gen, name, rank, shapes, layers, skip=()):
    weights = {
        (layer, m): (_rand(gen, rank, i), _rand(gen, o, rank))
        for layer in range(layers)
        for m, (i, o) in shapes.items()
        if m not in skip
    }  # fmt: skip
    return LoraAdapter(name, f"/adapters/{name}", rank, 2.0 / rank, weights)


@pytest.mark.skipif(
    not batched_for(torch.bfloat16)[1], reason="the table's lora_batched reads the standard stacks here (ISA or cap)"
)
def test_a_lora_set_with_blocked_stacks_updates_as_the_twins_layout():
    gen = torch.Generator().manual_seed(3)
    shapes = {"q_proj": (70, 70), "k_proj": (70, 33), "v_proj": (70, 33), "o_proj": (70, 70),
              "gate_proj": (70, 100), "up_proj": (70, 100), "down_proj": (100, 70)}  # fmt: skip
    adapters = [_adapter(gen, "a", 6, shapes, 2), _adapter(gen, "b", 8, shapes, 2, skip=("k_proj", "up_proj")),
                _adapter(gen, "c", 4, shapes, 2)]  # fmt: skip
    loras = LoraSet(adapters, ModuleShapes(2, shapes), torch.bfloat16, max_loras=2)
    assert loras.blocked == blocked(op("lora_batched", BLOCKED[0]), torch.bfloat16)
    table = loras.batched_op, loras.blocked
    t = 19
    for names in (["a", "b"], ["c", "b"]):  # then c takes a's slot: the blocked slot rewritten in place
        if "c" in names:
            loras.slots.admit("c", lambda: ["b"])
        reqs = {f"r{i}": SimpleNamespace(lora=[*names, None][i % 3]) for i in range(t)}
        widths = {"qkv": 136, "o": 70, "gate_up": 200, "down": 70}
        got: dict = {}
        for layout in (table, (lora_batched_parts, False)):
            loras.use_batched(*layout)
            step = loras.step({rid: 1 for rid in reqs}, reqs)
            assert step is not None and step.batch is not None
            for layer in range(2):
                for fused, d_out in widths.items():
                    d_in = 100 if fused == "down" else 70
                    x = _rand(torch.Generator().manual_seed(layer), t, d_in, std=1.0)
                    y0 = torch.randn(t, d_out, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
                    y = y0.clone()
                    step.apply(layer, fused, x, y)
                    assert torch.equal(y[2::3], y0[2::3]) and not torch.equal(y[0::3], y0[0::3])
                    got.setdefault((layer, fused), []).append(y)
        for key, (blk, twin) in got.items():
            torch.testing.assert_close(blk, twin, atol=ATOL, rtol=RTOL, msg=f"{names} {key}")
        loras.use_batched(*table)
    assert set(FUSED) == set(widths)

"""The decoder's fused element-wise C++ ops (kernels/cpu/csrc/fused/, every ISA variant this
machine executes) against the PyTorch they replace.

The ops round to the tensor dtype where the unfused ops store a tensor, so in bf16 they agree bit
for bit except where the mean's different summation order moves a value across a rounding
boundary; in fp32 (which the decoder does not fuse) within a few units in the last place.
Skipped if the library cannot be built (the decoder then runs unfused).
"""

import pytest
import torch
import torch.nn.functional as F
from cpu_variants import LOADED, REASON, op, params

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.kernels import dispatch
from orcaserve.kernels.pytorch.attention import store_kv
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.decoder import rms_norm

if not LOADED:
    pytest.skip(f"C++ CPU ops not built: {REASON}", allow_module_level=True)
VARIANTS = params("add_rms_norm")

# (relative size of one unit in the last place, units allowed, share of elements allowed to differ):
# in bf16 a different last bit of the fp32 statistics rarely survives the rounding, but where it
# does, the normalised value is one unit off before the weight multiplies it, and a weight above 1
# makes that two units of the product (seen on AVX2, whose 8-lane sums differ from ATen's more
# often); in fp32 it shows in every element of the row, by a few units.
LIMITS = {torch.float32: (2**-23, 4, 1.0), torch.bfloat16: (2**-8, 2, 0.02)}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    ulp, units, share = LIMITS[dtype]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    assert (err <= want.abs() * 2 * ulp * units + 1e-30).all(), f"{what}: over {units} ulp ({err.max():.3g})"
    assert (err > 0).float().mean().item() <= share, f"{what}: {(err > 0).float().mean():.2%} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 32, 515])
@pytest.mark.parametrize("variant", VARIANTS)
def test_add_rms_norm(dtype, rows, variant):
    g = torch.Generator().manual_seed(rows)
    x, delta = (torch.randn(rows, 576, generator=g) * 3).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    s, y = op("add_rms_norm", variant)(x, delta, weight, 1e-5)
    assert torch.equal(s, x + delta)
    close(y, rms_norm(x + delta, weight, 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 32, 300])
@pytest.mark.parametrize("variant", VARIANTS)
def test_silu_mul(dtype, rows, variant):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(op("silu_mul", variant)(gate_up), F.silu(gate) * up, dtype, "silu_mul")


@pytest.mark.parametrize("width", [32, 1536, 4096])
@pytest.mark.parametrize("variant", VARIANTS)
def test_silu_mul_fp32_bit_exact(width, variant):
    """Where the intermediate size is a multiple of 32 (ATen's vector loop covers every row), fp32
    is bit for bit F.silu(gate) * up in the variant whose vector code is ATen's own on this CPU:
    the decoder then fuses it in fp32 too (Decoder.exact_silu). Other variants' exp differs in the
    last bits (e.g. generic against ATen's AVX2), within the fp32 limits."""
    g = torch.Generator().manual_seed(width)
    gate_up = torch.randn(37, 2 * width, generator=g) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    got = op("silu_mul", variant)(gate_up)
    if variant == dispatch.aten_variant():
        assert torch.equal(got, F.silu(gate) * up)
    else:
        close(got, F.silu(gate) * up, torch.float32, "silu_mul")


def unfused_rope_store(qkv, cos, sin, k_cache, v_cache, slots, h, hk):
    """The decoder's unfused path: rotate q and k together, then the backends' store_kv."""
    d = cos.shape[-1]
    qk = qkv[:, : (h + hk) * d].view(-1, h + hk, d)
    qk = qk * cos[:, None] + qk.roll(d // 2, dims=-1) * sin[:, None]
    q, k = qk.split([h, hk], dim=1)
    store_kv(k, v := qkv[:, (h + hk) * d :].view(-1, hk, d), k_cache, v_cache, slots)
    return q, v


# (rows, (H, H_kv), D): SmolLM2's heads over a decode, a batch and a prefill chunk; a head dim that
# is not a multiple of the vector width
SHAPES = [(1, (9, 3), 64), (32, (9, 3), 64), (515, (9, 3), 64), (7, (4, 4), 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "heads", "d"), SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_store_kv_bit_exact(dtype, rows, heads, d, variant):
    """q, the stored k and v bit for bit those of the unfused ops (fp32 included: the token-exact
    tests run through it); slots of -1 store nothing."""
    (h, hk), bs, blocks = heads, 16, 40
    g = torch.Generator().manual_seed(rows + d)
    qkv = (torch.randn(rows, (h + 2 * hk) * d, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 4000, (rows,), generator=g).float()[:, None] / (10000 ** (torch.arange(d) % (d // 2) / d))
    cos, sin = pos.cos().to(dtype), pos.sin().to(dtype)
    sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    slots = torch.randperm(blocks * bs, generator=g)[:rows]
    slots[::5] = -1
    caches = [torch.randn(blocks, bs, hk, d, generator=g).to(dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    want_q, _ = unfused_rope_store(qkv, cos, sin, want_k, want_v, slots, h, hk)
    got_k, got_v = (c.clone() for c in caches)
    got_q = op("rope_store_kv", variant)(qkv, cos, sin, got_k, got_v, slots, h, hk)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rejects_bad_input(variant):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="delta"):
        op("add_rms_norm", variant)(x, torch.randn(4, 9), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="odd width"):
        op("silu_mul", variant)(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        op("silu_mul", variant)(torch.randn(8, 4).t())
    cache, trig, rope = torch.zeros(2, 4, 1, 8), torch.zeros(3, 8), op("rope_store_kv", variant)
    with pytest.raises(RuntimeError, match="slot out of range"):
        rope(torch.zeros(3, 24), trig, trig, cache, cache.clone(), torch.tensor([0, 1, 8]), 1, 1)
    with pytest.raises(RuntimeError, match="qkv width"):
        rope(torch.zeros(3, 25), trig, trig, cache, cache.clone(), torch.tensor([0, 1, 2]), 1, 1)


def test_bf16_engine_fused_matches_unfused(engine_for):
    """Every step of a bf16 engine on a tiny Llama computed both ways: the fused decoder's logits
    stay within bf16 noise of the unfused ones and pick the same greedy token almost always."""
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=64, dtype="bfloat16")
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.fused
    forward, pairs = decoder.forward, []

    def both_ways(*args, **kwargs):
        decoder.fused = False
        unfused = forward(*args, **kwargs)
        decoder.fused = True
        fused = forward(*args, **kwargs)  # rewrites this step's K/V: the run goes on with the fused values
        pairs.append((unfused, fused))
        return fused

    decoder.forward = both_ways
    prompts = [[(7 * i + j) % (TINY_VOCAB - 3) + 3 for j in range(5 + 9 * i)] for i in range(6)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    unfused, fused = torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
    assert (fused - unfused).abs().max() <= 0.05 * unfused.abs().max()
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() >= 0.9

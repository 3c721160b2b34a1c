"""The decoder layer as one C++ call (scheduler/model/layer_call.py): bit for bit the op-by-op loop
it replaces, and used only where every op of the layer is the C++ op it would call."""

from __future__ import annotations

import copy

import pytest

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build
from orcaserve.kernels.linear import GEMV_ROWS
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.model.layer_call import GEMMS

# Three layers, each in one call (the first with no MLP output to add yet).
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
# A long prompt is chunked (64 tokens a step) beside the others' decodes: steps of 1 to 64 rows.
PROMPTS = [[5, 6, 7, 8], [9] * 40, list(range(3, 150))]


def _engine(model, tokenizer, **kw):
    # 64 MiB of KV as conftest's engine_for gives (the CPU default's 1 GiB is zero-filled per engine)
    return Engine.from_model(
        copy.deepcopy(model), tokenizer, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=64 << 20, **kw
    )


def _same_tokens(one, loop, rows=None):
    """Run the prompts through both engines (`one` with its layer call, `loop` without): greedy tokens
    and log-probabilities bit for bit; every layer ran as one call (their rows in `rows`)."""
    call = one.runner.decoder.layer_call
    assert call is not None
    loop.runner.decoder.layer_call = None
    calls, seen = [], rows if rows is not None else []
    every = call.all

    def counted(x, *a):
        calls.append(len(call.layers))
        seen.append(len(x))
        return every(x, *a)

    call.all = counted
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    for a, b in zip(one.generate(PROMPTS, params), loop.generate(PROMPTS, params)):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 12
        assert a.logprobs == b.logprobs and a.logprobs  # each token's and the top 3, bit for bit
    assert calls and set(calls) == {3}


@pytest.mark.parametrize("stack", [True, False], ids=["a-call-a-step", "a-call-a-layer"])
@pytest.mark.parametrize(("arch", "dtype"), [("LlamaForCausalLM", "float32"), ("Qwen2ForCausalLM", "bfloat16")])
def test_one_call_is_the_op_by_op_loop(arch, dtype, stack, tokenizer):
    """GGUF codes against int8 activations (Qwen2: q/k/v biases too); every layer in one call a step
    (`decoder_layers`) and the final norm in one (`final_norm`), or one call a layer and the final
    norm's PyTorch ops (a library without those)."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family(arch, **SHAPE)
    one = _engine(model, tokenizer, dtype=dtype, quantization="int4", activations="int8")
    loop = _engine(model, tokenizer, dtype=dtype, quantization="int4", activations="int8")
    call = one.runner.decoder.layer_call
    assert call is not None and call.stack_op is not None and call.norm_op is not None
    if not stack:
        call.stack_op = call.norm_op = None
    _same_tokens(one, loop)


# Dense weights on every capability with a C++ GEMM this machine executes (the dispatch table's cap):
# the fp32 GEMM widening bf16 panels (avx2, avx512), the vdpbf16ps one (avx512_bf16, and on amx for
# the GEMV-shaped steps only: oneDNN's tiles run the larger ones); fp32 weights on the widest.
CAPS = [c for c in ("avx2", "avx512", "avx512_bf16", "amx") if c in build.machine_variants()]
DENSE = [(c, "bfloat16") for c in CAPS] + [(c, "float32") for c in CAPS[-1:]]


@pytest.mark.parametrize(("cap", "dtype"), DENSE)
def test_dense_one_call_is_the_op_by_op_loop(cap, dtype, tokenizer, monkeypatch):
    """Dense weights (a safetensors checkpoint's path), Qwen2's q/k/v biases too."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    monkeypatch.setenv("ORCASERVE_CPU_ISA", cap)
    model = tiny_family("Qwen2ForCausalLM", **SHAPE)
    one, loop = _engine(model, tokenizer, dtype=dtype), _engine(model, tokenizer, dtype=dtype)
    call = one.runner.decoder.layer_call
    bf16_gemm = dtype == "bfloat16" and cap in ("avx512_bf16", "amx")
    assert call is not None and GEMMS[call.variants[5]] == ("linear_packed_bf16" if bf16_gemm else "linear_packed")
    assert call.max_rows == (GEMV_ROWS if cap == "amx" and dtype == "bfloat16" else 1 << 62)
    rows: list[int] = []
    _same_tokens(one, loop, rows)
    assert max(rows) <= call.max_rows and (cap == "amx" or max(rows) > GEMV_ROWS)


def test_only_where_every_op_is_a_cpp_op(tokenizer, monkeypatch):
    """Widened codes (fp32 activations), dense weights on a library's GEMM, Qwen3's q/k norms: the
    loop runs."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    llama = tiny_family("LlamaForCausalLM", **SHAPE)
    assert _engine(llama, tokenizer, quantization="int4").runner.decoder.layer_call is None
    qwen3 = tiny_family("Qwen3ForCausalLM", **SHAPE)
    assert _engine(qwen3, tokenizer, quantization="int4", activations="int8").runner.decoder.layer_call is None
    monkeypatch.setenv("ORCASERVE_CPU_ISA", "generic")  # fp32: MKL's or oneDNN's GEMM; bf16: F.linear
    assert _engine(llama, tokenizer, dtype="float32").runner.decoder.layer_call is None
    assert _engine(llama, tokenizer, dtype="bfloat16").runner.decoder.layer_call is None

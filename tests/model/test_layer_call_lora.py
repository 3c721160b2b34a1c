"""The decoder layer as one C++ call with a step's LoRA adapters inside it (`decoder_layers_lora`,
scheduler/model/layer_call.py): bit for bit the op-by-op loop with `LoraStep.apply` it replaces, on
steps mixing several adapters and base rows, prefill chunks and decodes (docs/lora.md "The layer
call with adapters")."""

from __future__ import annotations

import copy

import pytest
from lora_adapters import make_adapter

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build
from orcaserve.scheduler import Engine, SamplingParams

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3}
# Chunked prompts (32 tokens a step) beside the others' decodes, four adapters and the base model.
PROMPTS = [[5, 6, 7, 8], [9] * 40, list(range(3, 80)), [11, 12] * 9, [4] * 7, list(range(20, 45))]
LORAS = ["a", None, "b", "c", "a", "d"]
CAPS = [c for c in ("avx2", "avx512", "avx512_bf16", "amx") if c in build.machine_variants()]
DENSE = [(c, "bfloat16") for c in CAPS] + [(c, "float32") for c in CAPS[-1:]]


def _adapters(base, path):
    """Four adapters of three ranks: every projection; q/v/down with rsLoRA; o/gate/up; q/k/v on one
    layer only (the others' projections take no part)."""
    make_adapter(base, path / "a", seed=1, r=8, alpha=16)
    make_adapter(base, path / "b", seed=2, r=4, alpha=8, rslora=True, targets=("q_proj", "v_proj", "down_proj"))
    make_adapter(base, path / "c", seed=3, r=16, alpha=16, targets=("o_proj", "gate_proj", "up_proj"))
    make_adapter(base, path / "d", seed=4, r=8, alpha=32, targets=("q_proj", "k_proj", "v_proj"), layers=[1])
    return {n: str(path / n) for n in "abcd"}


def _engine(model, tokenizer, dtype, paths):
    return Engine.from_model(
        copy.deepcopy(model), tokenizer, dtype=dtype, max_num_seqs=6, max_num_batched_tokens=32,
        kv_cache_memory=64 << 20, lora_adapters=paths,
    )  # fmt: skip


def _run(engine, loras):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras)):
        engine.add_request(f"r{i}", prompt, params, lora=lora)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(done))]


def _same_as_the_loop(model, tokenizer, dtype, paths, loras):
    """Both engines over `loras` (each prompt's adapter): tokens and log-probabilities bit for bit;
    the (rows, adapters in the step) of each step that ran as one call."""
    one, loop = _engine(model, tokenizer, dtype, paths), _engine(model, tokenizer, dtype, paths)
    call, loop_call = one.runner.decoder.layer_call, loop.runner.decoder.layer_call
    assert call is not None and call.lora_op is not None and call.sgmv_op is not None and loop_call is not None
    loop_call.with_lora = False  # the A/B switch: steps with adapters take the loop
    seen: list[tuple[int, int]] = []
    every = call.all

    def counted(x, *a):
        lora = a[-1]
        assert lora is None or call.takes(lora)
        seen.append((len(x), 0 if lora is None else len(lora.rows)))
        return every(x, *a)

    call.all = counted
    for a, b in zip(_run(one, loras), _run(loop, loras)):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 10
        assert a.logprobs == b.logprobs and a.logprobs  # each token's and the top 3, bit for bit
    return seen


@pytest.mark.parametrize(("cap", "dtype"), DENSE)
def test_layer_call_with_adapters_is_the_op_by_op_loop(cap, dtype, tokenizer, tmp_path, monkeypatch):
    """Dense weights (Qwen2's q/k/v biases too), the dispatch table's `lora_batched` and `lora_sgmv`
    of each capability (the blocked stacks on avx512_bf16 in bf16): greedy tokens and
    log-probabilities bit for bit the loop's, every step with adapters in the call, rows of prefill
    and decode."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    monkeypatch.setenv("ORCASERVE_CPU_ISA", cap)
    model = tiny_family("Qwen2ForCausalLM", **SHAPE)
    seen = _same_as_the_loop(model, tokenizer, dtype, _adapters(model, tmp_path), LORAS)
    several = [rows for rows, n in seen if n > 1]
    assert len(several) >= 3 and max(several) > 16 and min(several) < 16  # prefill chunks and decodes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layer_call_with_one_adapter_is_the_op_by_op_loop(dtype, tokenizer, tmp_path):
    """One adapter beside base requests (`lora_sgmv`, its rows gathered by index, its own weights)."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family("Qwen2ForCausalLM", **SHAPE)
    seen = _same_as_the_loop(model, tokenizer, dtype, _adapters(model, tmp_path), ["a", None, "a", None, "a", "a"])
    one = [rows for rows, n in seen if n == 1]
    assert len(one) >= 3 and max(one) > 16 and min(one) < 16


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_few_rows_with_adapters_keep_their_update(dtype, tokenizer, tmp_path):
    """Steps of 1-4 rows, where the call runs a step without adapters in one OpenMP region
    (docs/one-stream.md "One OpenMP region a step"): with adapters they still take the update."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family("LlamaForCausalLM", **SHAPE)
    seen = _same_as_the_loop(model, tokenizer, dtype, _adapters(model, tmp_path), ["a", "c", None])
    assert any(rows <= 4 and n > 0 for rows, n in seen)


def test_the_twins_keep_the_loop(tokenizer, tmp_path):
    """The PyTorch twins' update runs op by op; the C++ cells in the call."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    from orcaserve.kernels.pytorch.lora import lora_batched_parts, lora_sgmv

    model = tiny_family("LlamaForCausalLM", **SHAPE)
    engine = _engine(model, tokenizer, "float32", _adapters(model, tmp_path))
    call, loras = engine.runner.decoder.layer_call, engine.runner.loras
    assert call is not None and call.takes(None)
    one = loras.step({"r0": 3, "r1": 2}, {"r0": _Req("a"), "r1": _Req(None)})
    several = loras.step({"r0": 3, "r1": 2}, {"r0": _Req("a"), "r1": _Req("b")})
    assert one is not None and several is not None and call.takes(one) and call.takes(several)
    loras.op = lora_sgmv
    loras.use_batched(lora_batched_parts, False)
    assert not call.takes(one) and not call.takes(several)


class _Req:
    def __init__(self, lora: str | None) -> None:
        self.lora = lora

"""LoRA adapters served in mixed steps are token for token transformers + PEFT with the adapter
applied, on every lean-decoder family; the prefix cache never serves K/V across adapters.

Each test makes two adapters with PEFT (random nonzero weights: their answers differ from the base
model's) with different ranks, targets and scaling, and serves requests of both and of the base
model together, arriving a few per step, with prompts long enough to be chunked."""

from __future__ import annotations

import random

import pytest
import torch
from lora_adapters import make_adapter, record_steps, run_mixed

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_family
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.errors import UnknownModel
from orcaserve.scheduler.model.families import LEAN


def _two_adapters(base, tmp_path):
    """ "a": rank 8, every projection; "b": rank 4, rsLoRA, attention q/v and the MLP's down only."""
    a = make_adapter(base, tmp_path / "a", seed=1, r=8, alpha=16)
    b = make_adapter(base, tmp_path / "b", seed=2, r=4, alpha=8, rslora=True, targets=("q_proj", "v_proj", "down_proj"))
    return {"a": a, "b": b}, {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}


def _work(seed: int, n: int) -> list[tuple[str, list[int], int, str | None]]:
    rng = random.Random(seed)
    adapters = ["a", "b", None]
    work = []
    for i in range(n):
        length = rng.choice([1, 5, 17, 40, 90])
        work.append(
            (f"r{i}", [rng.randrange(3, TINY_VOCAB) for _ in range(length)], rng.randint(4, 12), adapters[i % 3])
        )
    return work


@pytest.mark.parametrize("arch", [a for a in LEAN if a != "BitNetForCausalLM"])  # BitNet: refused (lora.md)
def test_mixed_adapters_and_base_match_peft(arch, engine_for, tmp_path):
    base = tiny_family(arch)
    refs, paths = _two_adapters(base, tmp_path)
    work = _work(seed=3, n=12)
    expected = {rid: hf_greedy(refs[lora] if lora else base, prompt, n) for rid, prompt, n, lora in work}
    # The adapters change the answers (else this test would prove nothing).
    for rid, prompt, n, lora in work:
        if lora is not None and len(prompt) > 4:
            assert expected[rid] != hf_greedy(base, prompt, n), (rid, lora)
    engine = engine_for(base, max_num_seqs=6, max_num_batched_tokens=48, lora_adapters=paths)
    steps = record_steps(engine)
    results = run_mixed(engine, work, per_step=3)
    mixed = [s for s in steps if s is not None and len(s.rows) == 2]
    assert mixed, "no step mixed the two adapters"
    assert any(isinstance(rows, torch.Tensor) for s in mixed for rows in s.rows.values()), "no gathered group"
    assert any(isinstance(rows, slice) for s in mixed for rows in s.rows.values()), "no contiguous group"
    for rid, prompt, _, lora in work:
        assert results[rid].output_token_ids == expected[rid], (rid, lora, len(prompt))
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_step_of_the_base_model_alone_adds_nothing(engine_for, tmp_path):
    """Without an adapter in the step the runner passes no LoRA work to the decoder at all."""
    base = tiny_family("LlamaForCausalLM")
    _, paths = _two_adapters(base, tmp_path)
    engine = engine_for(base, lora_adapters=paths)
    seen = record_steps(engine)
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert seen and all(s is None for s in seen)


def test_prompt_logprobs_under_an_adapter_are_pefts(engine_for, tmp_path):
    base = tiny_family("Qwen2ForCausalLM")
    refs, paths = _two_adapters(base, tmp_path)
    engine = engine_for(base, lora_adapters=paths)
    prompt = [random.Random(0).randrange(3, TINY_VOCAB) for _ in range(30)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    engine.add_request("p", prompt, params, lora="b")
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    with torch.inference_mode():
        logits = refs["b"](torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([lp.logprob for lp in final.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_unknown_adapter_is_refused_and_nothing_queued(engine_for, tmp_path):
    base = tiny_family("LlamaForCausalLM")
    _, paths = _two_adapters(base, tmp_path)
    engine = engine_for(base, lora_adapters=paths)
    with pytest.raises(UnknownModel, match="'c' does not exist.*a, b") as e:
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), lora="c")
    assert e.value.param == "lora" and not engine.has_unfinished()
    plain = engine_for(base)
    with pytest.raises(UnknownModel, match="served: none"):
        plain.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), lora="a")


def test_the_prefix_cache_never_crosses_adapters(engine_for, tmp_path):
    """The same prompt under the base model, adapter a, adapter b and a again: each of the first
    three computes it whole (nothing cached under another adapter is served), the last finds it
    under a; every answer is still exact."""
    base = tiny_family("LlamaForCausalLM")
    refs, paths = _two_adapters(base, tmp_path)
    engine = engine_for(base, lora_adapters=paths, block_size=16)
    prompt = [random.Random(5).randrange(3, TINY_VOCAB) for _ in range(70)]
    cached = {}
    for rid, lora in [("base", None), ("a", "a"), ("b", "b"), ("a2", "a"), ("base2", None)]:
        (out,) = run_mixed(engine, [(rid, prompt, 6, lora)]).values()
        cached[rid] = out.num_cached_tokens
        assert out.output_token_ids == hf_greedy(refs[lora] if lora else base, prompt, 6), rid
    assert cached == {"base": 0, "a": 0, "b": 0, "a2": 64, "base2": 64}


def test_an_adapter_on_some_layers_only_matches_peft(engine_for, tmp_path):
    """`layers_to_transform`: the file holds the second layer's weights alone."""
    base = tiny_family("MistralForCausalLM")
    ref = make_adapter(
        base, tmp_path / "l1", seed=4, r=16, alpha=8, layers=[1], targets=("k_proj", "o_proj", "up_proj")
    )
    engine = engine_for(base, lora_adapters={"l1": str(tmp_path / "l1")})
    assert {layer for layer, _ in engine.runner.loras.adapters["l1"].weights} == {1}
    work = _work(seed=6, n=6)
    work = [(rid, prompt, n, "l1" if lora else None) for rid, prompt, n, lora in work]
    results = run_mixed(engine, work, per_step=6)
    for rid, prompt, n, lora in work:
        assert results[rid].output_token_ids == hf_greedy(ref if lora else base, prompt, n), (rid, lora)
    adapted = [(rid, prompt, n) for rid, prompt, n, lora in work if lora]
    assert any(results[rid].output_token_ids != hf_greedy(base, prompt, n) for rid, prompt, n in adapted)

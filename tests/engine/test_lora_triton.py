"""LoRA adapters on the engine's Triton path (the Triton shrink/expand through the dispatch table,
the stacks and step descriptors on the model's device), under the interpreter in fp32: token for
token the CPU engine's and PEFT's, in steps mixing adapters and base rows, with an adapter loaded
and another unloaded while serving and overlapped scheduling on (docs/lora.md "The Triton kernels
in the engine")."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_script

pytestmark = pytest.mark.slow  # the whole engine under the Triton interpreter

SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"  # before any kernel is defined
    import copy, random, sys, tempfile
    from pathlib import Path
    sys.path.insert(0, "tests")
    from lora_adapters import make_adapter, record_steps, run_mixed
    from orcaserve.bench.models.tiny import hf_greedy, tiny_family
    from orcaserve.scheduler import Engine
    from orcaserve.bench.gpu.common import ByteTokenizer  # prompts are token ids
    from orcaserve.kernels.triton.lora_cells import TritonLora

    base = tiny_family("LlamaForCausalLM", vocab_size=64, intermediate_size=96, head_dim=16,
                       max_position_embeddings=256)
    tmp = Path(tempfile.mkdtemp())
    refs = {
        "a": make_adapter(base, tmp / "a", seed=1, r=8, alpha=16),
        "b": make_adapter(base, tmp / "b", seed=2, r=4, alpha=8, rslora=True,
                          targets=("q_proj", "v_proj", "down_proj")),
        "c": make_adapter(base, tmp / "c", seed=3, r=16, alpha=16, targets=("k_proj", "o_proj", "up_proj")),
    }
    rng = random.Random(3)
    names = ["a", "b", None, "a", None, "b", "a", "b", None]
    first = [(f"r{i}", [rng.randrange(3, 64) for _ in range(rng.choice([1, 5, 17, 30]))], rng.randint(3, 6), lora)
             for i, lora in enumerate(names)]
    second = [(f"s{i}", [rng.randrange(3, 64) for _ in range(rng.choice([4, 12]))], 4, lora)
              for i, lora in enumerate(["c", None, "b", "c"])]
    for rid, prompt, n, lora in first + second:  # the adapters change the answers
        if lora is not None and len(prompt) > 4:
            assert hf_greedy(refs[lora], prompt, n) != hf_greedy(base, prompt, n), rid

    def serve(backend):  # the Triton side overlaps the host's work with the step's, as on a GPU
        engine = Engine.from_model(copy.deepcopy(base), ByteTokenizer(), attention_backend=backend, max_num_seqs=6,
                                   max_num_batched_tokens=40, block_size=16, dtype="float32", max_loras=2,
                                   enable_lora=True, lora_adapters={"a": str(tmp / "a"), "b": str(tmp / "b")},
                                   async_scheduling=backend == "triton")
        steps = record_steps(engine)
        stacks = {k: (a.data_ptr(), b.data_ptr()) for k, (a, b) in engine.runner.loras._stacks.items()}
        out = run_mixed(engine, first, per_step=3)
        engine.loras.add(engine.loras.read("c", str(tmp / "c")))  # loaded while serving
        engine.loras.remove("a")  # unloaded: no request in flight names it
        out.update(run_mixed(engine, second, per_step=2))
        kept = stacks == {k: (a.data_ptr(), b.data_ptr()) for k, (a, b) in engine.runner.loras._stacks.items()}
        return engine, steps, {rid: o.output_token_ids for rid, o in out.items()}, kept

    engine, steps, got, kept = serve("triton")
    loras = engine.runner.loras
    # allocated once, every projection at max_lora_rank (16): "c" (rank 16, other modules) swapped in
    assert kept and loras.rank == 16 and len(loras._stacks) == 2 * 7, (kept, loras.rank, len(loras._stacks))
    assert isinstance(loras.batched_op.__self__, TritonLora) and isinstance(loras.op.__self__, TritonLora)
    assert all(t.device == base.lm_head.weight.device for ab in loras._stacks.values() for t in ab)
    assert any(s is not None and s.batch is not None for s in steps), "no step of several adapters"
    assert any(s is not None and s.batch is None for s in steps), "no step of one adapter"
    uploads = loras.batched_op.__self__.buffers.uploads
    assert 0 < uploads <= sum(s is not None for s in steps), uploads  # one per step, not per projection
    _, _, cpu, _ = serve("cpu")
    assert got == cpu, (got, cpu)
    for rid, prompt, n, lora in first + second:
        assert got[rid] == hf_greedy(refs[lora] if lora else base, prompt, n), rid
    print("triton lora ok", uploads, "uploads over", len(steps), "steps")
    """
)


def test_lora_on_the_triton_path_under_interpreter_matches_the_cpu_engine_and_peft():
    run_script(SCRIPT, "triton lora ok", timeout=900)

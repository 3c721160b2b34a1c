"""The CUDA-graph runner's host side, checked on the CPU: bucket choice, the step buffers and their
padding, and that a step padded to its graph's sizes computes exactly what the unpadded step does
(only the capture itself needs a GPU)."""

from __future__ import annotations

import copy
import os
import subprocess
import textwrap
from array import array

import pytest
import torch
from interpreted import run_script

from orcaserve.bench.cli import command
from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.kernels.pytorch import attention as torch_attention
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.cuda_graphs import GraphKey, bucket_sizes, padded_size
from orcaserve.scheduler.model.step_buffers import StepBuffers


class _ByteTokenizer:
    """The engine needs encode/decode/eos only; prompts here are token ids (no 10 s tokenizer load)."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 256 for i in ids).decode("latin-1")


@pytest.fixture
def engine_for():
    """conftest's fixture, with a byte tokenizer: an fp32 engine over a private copy of `model`
    (its 64 MiB of KV unless `kv_cache_memory` says otherwise)."""

    def make(model, **engine_args):
        defaults = {"dtype": "float32", "kv_cache_memory": 64 << 20}
        return Engine.from_model(copy.deepcopy(model), _ByteTokenizer(), **{**defaults, **engine_args})

    return make


def test_bucket_sizes_are_dense_where_decodes_are_and_pad_at_most_an_eighth_above():
    sizes = bucket_sizes(4096)
    assert sizes[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert sizes[sizes.index(128) : sizes.index(128) + 3] == [128, 144, 160]
    assert sizes[sizes.index(1024) : sizes.index(1024) + 2] == [1024, 1152]
    assert sizes[-1] == 4096 and len(sizes) == 59 and len(bucket_sizes(256)) == 27
    assert sizes == sorted(set(sizes))
    assert all((b - a) / a <= 0.125 for a, b in zip(sizes, sizes[1:]) if a >= 64)
    assert bucket_sizes(3) == [1, 2, 3] and bucket_sizes(1) == [1] and bucket_sizes(100)[-2:] == [96, 100]
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 129, 4095, 4096, 4097)] == [1, 4, 8, 16, 144, 4096, 4096, None]


class _Blocks:
    """Stands in for the KV cache manager: only `tables_of` is read (int64 arrays, as its own)."""

    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    def tables_of(self, rids) -> list[array[int]]:
        return [array("q", self.tables[rid]) for rid in rids]


def _step() -> tuple[SchedulerOutput, _Blocks]:
    """A prefill chunk with history, a fresh prompt (not sampling: chunked) and two decodes."""
    reqs = {}
    for rid, prompt, computed in (("a", range(100, 140), 16), ("b", range(200, 230), 0), ("c", [7] * 5, 4)):
        r = Request(EngineRequest(rid, list(prompt), arrival_time=0.0))
        r.num_computed_tokens = computed
        reqs[rid] = r
    d = Request(EngineRequest("d", list(range(300, 317)), arrival_time=0.0))
    d.num_computed_tokens = 16
    reqs["d"] = d
    sched = SchedulerOutput(
        num_scheduled_tokens={"a": 24, "b": 6, "c": 1, "d": 1},
        requests=reqs,
        sampling=[reqs["a"], reqs["c"], reqs["d"]],
    )
    return sched, _Blocks({"a": [9, 3, 5], "b": [2], "c": [7], "d": [4, 8]})


def test_buffers_hold_the_step_and_pad_it_to_write_nowhere():
    sched, kv = _step()
    buf = StepBuffers(max_tokens=64, max_seqs=8, max_blocks=4, block_size=16, device=torch.device("cpu"))
    buf.np["slots"][:] = 12345  # stale values of an earlier step
    shape = buf.prepare(sched, kv)
    assert (shape.num_tokens, shape.num_seqs, shape.num_samples, shape.width) == (32, 4, 3, 3)
    assert (shape.max_seqlen_q, shape.max_seqlen_k, shape.decode_only) == (24, 40, False)
    t = buf.tensors(shape.num_tokens, shape.num_seqs, shape.num_samples, shape.width)
    positions = list(range(16, 40)) + list(range(0, 6)) + [4, 16]
    tables = [[9, 3, 5]] * 24 + [[2]] * 6 + [[7]] + [[4, 8]]
    assert t.positions.tolist() == positions
    assert t.input_ids.tolist() == list(range(116, 140)) + list(range(200, 206)) + [7, 316]
    assert t.slot_mapping.tolist() == [tb[p // 16] * 16 + p % 16 for tb, p in zip(tables, positions)]
    assert t.cu_seqlens_q.tolist() == [0, 24, 30, 31, 32] and t.seq_lens.tolist() == [40, 6, 5, 17]
    assert t.block_tables.tolist() == [[9, 3, 5], [2, 0, 0], [7, 0, 0], [4, 8, 0]]
    assert t.sample_rows.tolist() == [23, 30, 31] and t.block_tables.dtype == t.cu_seqlens_q.dtype == torch.int32

    buf.pad(shape, 40, 6, 6)
    buf.upload(shape, graph_table=True)
    p = buf.tensors(40, 6, 6, width=None)
    assert p.slot_mapping.tolist() == t.slot_mapping.tolist() + [-1] * 8
    assert p.input_ids[32:].tolist() == [0] * 8 and p.positions[32:].tolist() == [0] * 8
    assert p.cu_seqlens_q.tolist() == [0, 24, 30, 31, 32, 32, 32] and p.seq_lens.tolist() == [40, 6, 5, 17, 0, 0]
    assert p.sample_rows.tolist() == [23, 30, 31, 0, 0, 0]
    assert p.block_tables.shape == (6, 4) and p.block_tables[:4, :3].tolist() == t.block_tables.tolist()


def test_steps_pick_decode_or_mixed_graphs(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=8, max_num_batched_tokens=64)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.decode_sizes == [1, 2, 4, 8]
    sched, kv = _step()
    shape = engine.runner.buffers.prepare(sched, kv)
    assert graphs.key_for(shape) == GraphKey(32, 8, False)  # 32 tokens is a bucket: only B pads
    decode = SchedulerOutput({"c": 1, "d": 1}, {r: sched.requests[r] for r in "cd"}, sampling=[])
    assert graphs.key_for(engine.runner.buffers.prepare(decode, kv)) == GraphKey(2, 2, True)


def test_the_runner_refuses_to_capture_off_cuda(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=4, max_num_batched_tokens=32)
    assert not engine.runner.use_graphs and engine.config.resolved_cuda_graphs() is False
    with pytest.raises(RuntimeError, match="CUDA"):
        engine.runner.graphs.capture(GraphKey(4, 4, True))
    assert EngineConfig(cuda_graphs=True, device="cpu").resolved_cuda_graphs() is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


def _workload(n: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    lengths = [1, 2, 15, 16, 17, 33, 70, 5, 9, 40, 3, 26][:n]
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, seed=11),
        dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        dict(temperature=1.0, top_k=20, top_p=0.9, seed=5, logit_bias={7: 5.0}),
    ]
    return [(p, SamplingParams(max_tokens=4 + i % 9, ignore_eos=True, **kinds[i % 4])) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_padded_step_computes_the_unpadded_logits_and_kv_bit_for_bit(engine_for, backend, caplog):
    """Each step runs twice from the same KV caches, unpadded and padded to its graph's sizes:
    the logits of the sampling rows and the caches after it must be identical."""
    # 12 blocks for 12 requests: preemption; 48 tokens a step: chunked prefills next to decodes.
    engine = engine_for(
        tiny_model("llama"),
        attention_backend=backend,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        kv_cache_memory=12 * 2 * 2 * 16 * 2 * 16 * 4,
    )
    runner, execute = engine.runner, engine.runner.execute
    padded = {"mixed": 0, "decode": 0}

    def checked(sched, kv):
        before = [(k.clone(), v.clone()) for k, v in engine.kv_caches]
        runner.pad_steps = False
        plain = execute(sched, kv).clone()
        after = [(k.clone(), v.clone()) for k, v in engine.kv_caches]
        for (k, v), (k0, v0) in zip(engine.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        shape = runner.buffers.prepare(sched, kv)
        key = runner.graphs.key_for(shape)
        if key.num_tokens > shape.num_tokens or key.num_seqs > shape.num_seqs:
            padded["decode" if key.decode else "mixed"] += 1
        runner.pad_steps = True
        logits = execute(sched, kv)
        assert torch.equal(logits, plain), (shape, key)
        for (k, v), (k1, v1) in zip(engine.kv_caches, after):
            assert torch.equal(k, k1) and torch.equal(v, v1), "a pad token wrote into the KV cache"
        return logits

    runner.execute = checked
    work = _workload(12)
    engine.generate([p for p, _ in work], [s for _, s in work])
    assert padded["mixed"] >= 3 and padded["decode"] >= 3, padded
    assert engine.stats.num_preemptions > 0
    assert "re-running" not in caplog.text  # no step failed and was split until it fit


def test_generate_is_token_exact_with_every_step_padded(engine_for, caplog):
    work = _workload(12)
    outs = {}
    for pad in (False, True):
        engine = engine_for(tiny_model("qwen2"), max_num_seqs=7, max_num_batched_tokens=40)
        engine.runner.pad_steps = pad
        outs[pad] = [o.output_token_ids for o in engine.generate([p for p, _ in work], [s for _, s in work])]
    assert outs[True] == outs[False]
    assert "re-running" not in caplog.text


def test_the_pytorch_twins_leave_pad_rows_and_skipped_slots_alone():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 16, 2, 8, generator=g)
    k_cache, v_cache = cache.clone(), cache.clone()
    key, value = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([3, 17, -1, 40, -1, -1])
    torch_attention.store_kv(key, value, k_cache, v_cache, slots)
    changed = (k_cache != cache).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [3, 17, 40] and torch.equal(k_cache.view(-1, 2, 8)[17], key[1])
    # 3 real tokens (a decode and a 2-token chunk), 3 pad rows, one pad request
    q = torch.randn(6, 4, 8, generator=g)
    out = torch.full((6, 4, 8), 7.0)
    cu, lens = torch.tensor([0, 1, 3, 3], dtype=torch.int32), torch.tensor([20, 9, 0], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 0], [0, 0]], dtype=torch.int32)
    plan = torch_attention.TorchAttentionPlan(cu, lens, tables, 16)
    plan.attend(q, k_cache, v_cache, 0.3, out)
    assert (out[3:] == 7.0).all() and (out[:3] != 7.0).all()
    want = torch_attention.unified_attention(q[:3], k_cache, v_cache, cu[:3], lens[:2], tables[:2], 0.3)
    assert torch.equal(out[:3], want)


TRITON_SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from orcaserve.kernels.pytorch import attention as ref
    from orcaserve.kernels.triton.attention import launch_unified
    from orcaserve.kernels.triton.split_k import launch_split_k
    from orcaserve.kernels.triton.store_kv import store_kv

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 16, 1, 16, generator=g)
    k_cache, v_cache = cache.clone(), cache.clone()
    key, value = torch.randn(4, 1, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 20, -1]), block_t=4)
    changed = (k_cache != cache).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [5, 20], changed
    # 3 real tokens (a decode, a 2-token chunk) padded to 8, a pad request with no queries
    q = torch.randn(8, 2, 16, generator=g)
    cu = torch.tensor([0, 1, 3, 3], dtype=torch.int32)
    lens = torch.tensor([20, 9, 0], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 0], [0, 0]], dtype=torch.int32)
    want = ref.unified_attention(q[:3], k_cache, v_cache, cu[:3], lens[:2], tables[:2], 0.25)
    for name, run in (
        ("unified", lambda out: launch_unified(q, k_cache, v_cache, cu, lens, tables, 0.25, out, 16, 16)),
        ("split_k", lambda out: launch_split_k(q, k_cache, v_cache, cu, lens, tables, 0.25, out, 2, 16, 16)),
    ):
        out = torch.full((8, 2, 16), 7.0)
        run(out)
        assert (out[3:] == 7.0).all(), name + ": a pad row was written"
        assert (out[:3] - want).abs().max() < 1e-5, name
    print("triton pad rows ok")
    """
)


def test_the_triton_kernels_leave_pad_rows_and_skipped_slots_alone():
    """Under the interpreter, fp32: store_kv skips slot -1; the unified and split-K kernels write
    no row past cu_seqlens_q[-1] and the real rows as the reference."""
    run_script(TRITON_SCRIPT, "triton pad rows ok", timeout=300)


@pytest.mark.slow
def test_gpu_graphs_benchmark_smoke(tmp_path):
    """`orcaserve-bench gpu graphs` (gpu_check.sh's step engine_graphs, GPU only) runs on the CPU with
    --smoke: its plumbing, so a GPU session does not find it broken."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "graphs.json"
    proc = subprocess.run(
        [*command("gpu"), "graphs", "--smoke", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    res = json.loads(out.read_text())
    assert res["exact_fp32"]["pass"] and res["on"]["padded_eager"] and not res["off"]["padded_eager"]
    assert [r["batch"] for r in res["on"]["decode"]] == [1, 3] and res["on"]["end_to_end"]["steps"] > 0


TRITON_ENGINE_SCRIPT = textwrap.dedent(
    """
    import copy, dataclasses, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from orcaserve.bench.gpu.common import ByteTokenizer as _ByteTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    from orcaserve.scheduler import Engine, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      initializer_range=0.2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 17, [3] * 5]
    got = {}
    for mode in ("plain", "padded", "padded, split-K"):
        e = Engine.from_model(copy.deepcopy(model), _ByteTokenizer(), attention_backend="triton", max_num_seqs=4,
                              max_num_batched_tokens=24, dtype="float32", kv_cache_memory=1 << 22)
        e.runner.pad_steps = mode != "plain"
        if mode == "padded, split-K":  # the fixed split counts of graphs, forced on short contexts
            g, orig = e.runner.graphs, e.runner.graphs._with_splits
            g._with_splits = lambda key, k: dataclasses.replace(orig(key, k), num_splits=3 if key.decode else 2)
        outs = e.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        got[mode] = [o.output_token_ids for o in outs]
    assert len(set(map(str, got.values()))) == 1, got
    print("triton padded engine ok")
    """
)


@pytest.mark.slow
def test_padded_steps_through_the_triton_kernels_are_token_exact():
    """The graph runner's padded inputs and fixed per-graph plans (split-K counts included) through
    the Triton kernels, under the interpreter in fp32: the same tokens as unpadded steps."""
    run_script(TRITON_ENGINE_SCRIPT, "triton padded engine ok", timeout=900)

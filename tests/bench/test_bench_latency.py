"""`orcaserve-bench latency` on a tiny model, offline: a row per stream count with tok/s, ms per
token and the DRAM roof; a peer that is not installed is named and skipped."""

from __future__ import annotations

import json

import pytest

from orcaserve.bench import cli
from orcaserve.bench.cpu import dram
from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels.cpu import build

KV = ["--set", f"kv_cache_memory={64 << 20}"]  # conftest's engine_for size: the default 1 GiB is zero-filled


def test_latency_runs_offline_on_a_tiny_model(tmp_path, tokenizer, capsys):
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tmp_path / "tiny"), "--streams", "1,2", "--input-len", "4"]
    argv += ["--output-len", "6", "--repeats", "1", "--modes", "offline", "--set", "dtype=float32", "--thread-cpu", *KV]
    assert cli.main([*argv, "--peers", "llamacpp,nope", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["systems"]["orcaserve offline"]
    assert [r["streams"] for r in rows] == [1, 2]
    assert all(r["tok_s"] > 0 and r["tpot_ms"] > 0 for r in rows)
    assert res["quantization"] == "none" and res["roof_tok_s"] > 0  # a directory is served dense
    # 2 layers of q/k/v/o and MLP plus the lm_head, fp32
    h, i, v, kv = 64, 128, 512, 32
    assert res["bytes_per_token"] == 4 * (2 * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h)
    assert "unknown peer" in res["skipped"]["nope"]
    assert "llamacpp" in res["skipped"] or "llamacpp http" in res["systems"]
    # --thread-cpu: each run's CPU by thread of this process (the client role: offline, no server)
    assert all(r["cpu"]["output_tokens"] == 6 * r["streams"] and r["cpu"]["totals_s"]["server"] == 0 for r in rows)
    printed = capsys.readouterr().out
    assert "DRAM roof" in printed
    assert "orcaserve offline, 2 stream(s), the best run: CPU over the measured load" in printed


def test_read_bandwidth_is_a_rate():
    assert 0.1 < dram.read_bandwidth(mib=64, repeats=2) < 10_000
    assert 0.1 < dram.sum_bandwidth(mib=64, repeats=2) < 10_000


def test_read_sweep_times_each_chunk():
    """The C++ probe returns one positive time a chunk, cycling over the buffer's chunks."""
    if not build.load(build=False)[0]:
        pytest.skip("C++ CPU ops not built")
    import torch

    seconds = torch.ops.orcaserve.read_sweep(torch.ones(1 << 20, dtype=torch.uint8), 1 << 18, 10)
    assert seconds.shape == (10,) and seconds.dtype == torch.float64 and bool((seconds > 0).all())
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.orcaserve.read_sweep(torch.ones(1 << 20, dtype=torch.uint8), 100, 1)


def test_breakdown_times_the_lean_decoders_ops(tmp_path, tokenizer, capsys):
    """--breakdown splits the model run op by op on the lean decoder, the lm_head included (its
    GEMM is the decoder's own, not the model's module), and leaves the engine as it found it."""
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tmp_path / "tiny"), "--streams", "1", "--input-len", "4", "--output-len", "6"]
    argv += ["--repeats", "1", "--modes", "offline", "--set", "dtype=float32", *KV, "--breakdown", "--out", str(out)]
    assert cli.main([*argv, "--op-by-op"]) == 0  # every layer op by op (the layer call holds all their ops)
    res = json.loads(out.read_text())
    b = res["breakdown"]["1"]
    for part in ("qkv", "o", "gate_up", "down", "lm_head", "attention", "add_rms_norm", "silu_mul"):
        assert b[part] > 0, part
    assert b["model"] >= sum(b[k] for k in ("qkv", "o", "gate_up", "down", "lm_head", "attention"))
    assert b["inputs"] > 0 and b["model"] - b["inputs"] > b["forward_rest"]  # the run less the forward
    # 2 layers' q/k/v (64 + 2 x 32 outputs of 64) in fp32
    assert res["breakdown_bytes"]["qkv"] == 4 * 2 * (64 + 2 * 32) * 64
    assert "of the model, by op: qkv" in capsys.readouterr().out


def test_breakdown_restores_the_engine(tokenizer):
    from orcaserve.bench.engine.step_breakdown import breakdown
    from orcaserve.scheduler.engine import Engine

    engine = Engine.from_model(
        tiny_family("LlamaForCausalLM"), tokenizer, dtype="float32", max_num_seqs=1, kv_cache_memory=64 << 20
    )
    decoder, backend = engine.runner.decoder, engine.runner.backend
    before = [layer.qkv for layer in decoder.layers], decoder.lm_head, decoder.add_rms_norm_op
    breakdown(engine, [[5, 6, 7]], 4)
    assert ([layer.qkv for layer in decoder.layers], decoder.lm_head, decoder.add_rms_norm_op) == before
    assert "attend" not in vars(backend) and "forward" not in vars(decoder)


@pytest.mark.parametrize("op_by_op", [False, True])
def test_breakdown_times_the_one_call_layers(tmp_path, tokenizer, op_by_op):
    """With int8 activations every layer runs as one C++ call, timed as `layer`; --op-by-op runs them
    op by op (the A/B)."""
    if not build.load(build=False)[0]:
        pytest.skip("the C++ library is not built")
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tmp_path / "tiny"), "--streams", "1", "--input-len", "4", "--output-len", "6"]
    argv += ["--repeats", "1", "--modes", "offline", *KV, "--breakdown", "--out", str(out)]
    argv += ["--set", "quantization=int4", "--set", "activations=int8", *(["--op-by-op"] if op_by_op else [])]
    assert cli.main(argv) == 0
    b = json.loads(out.read_text())["breakdown"]["1"]
    assert (b["layer"] == 0) == op_by_op
    assert (b["qkv"] > 0 and b["attention"] > 0) == op_by_op  # the call holds every layer's ops

"""`orcaserve-bench latency` on a tiny model, offline: a row per stream count with tok/s, ms per
token and the DRAM roof; a peer that is not installed is named and skipped."""

from __future__ import annotations

import json

from orcaserve.bench import cli
from orcaserve.bench.cpu import dram
from orcaserve.bench.models.tiny import tiny_family


def test_latency_runs_offline_on_a_tiny_model(tmp_path, tokenizer, capsys):
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tmp_path / "tiny"), "--streams", "1,2", "--input-len", "4"]
    argv += ["--output-len", "6", "--repeats", "1", "--modes", "offline", "--set", "dtype=float32"]
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
    assert "DRAM roof" in capsys.readouterr().out


def test_read_bandwidth_is_a_rate():
    assert 0.1 < dram.read_bandwidth(mib=64, repeats=2) < 10_000

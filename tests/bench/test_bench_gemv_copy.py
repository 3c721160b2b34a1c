"""`orcaserve-bench kernels gemv-copy` on a tiny model: both paths decode, their rows are printed,
and the second copies are counted where the table gives bf16 one (AMX)."""

from __future__ import annotations

import json

import pytest

from orcaserve.bench import cli
from orcaserve.bench.models.tiny import tiny_family
from orcaserve.kernels import dispatch


@pytest.mark.slow  # two decodes of a tiny model through the benchmark; the full suite runs it
def test_gemv_copy_runs_both_paths(tmp_path, tokenizer, capsys):
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "gemv.json"
    argv = ["kernels", "gemv-copy", "--model", str(tmp_path / "tiny"), "--streams", "1,2", "--pairs", "2"]
    assert cli.main([*argv, "--output-len", "4", "--input-len", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["streams"], r["path"]) for r in res["rows"]] == [(1, "gemv"), (1, "onednn"), (2, "gemv"), (2, "onednn")]
    assert all(len(r["tok_s"]) == 2 and min(r["cpu_ms_step"]) > 0 for r in res["rows"])
    two_copies = dispatch.resolve("linear_gemv", "bfloat16") != dispatch.resolve("linear", "bfloat16")
    assert (res["second_copy_bytes"] > 0) == two_copies
    assert "second copies" in capsys.readouterr().out

"""`orcaserve-bench closed-loop` on a tiny model: the HTTP load's requests through the engine
directly and through its serving thread (a process each), every requested token counted, the
steps and the CPU of the process's threads reported."""

from __future__ import annotations

import json

import pytest

from orcaserve.bench import cli
from orcaserve.bench.models.tiny import tiny_family
from orcaserve.bench.serve.workload import make_workload


@pytest.mark.slow  # two closed loops of a tiny model (~19 s); the full suite runs it
def test_closed_loop_runs_both_ways_on_a_tiny_model(tmp_path, tokenizer):
    model = tiny_family("LlamaForCausalLM")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    argv = ["closed-loop", "--model", str(tmp_path / "tiny"), "--dtype", "fp32", "--num-requests", "7"]
    argv += ["--concurrency", "3", "--warmup-load", "2", "--input-len", "4:20", "--output-len", "2:9"]
    argv += ["--token-range", "100:500"]
    requested = sum(s.max_tokens for s in make_workload(7, 0, (4, 20), (2, 9), (100, 500)))
    out = tmp_path / "both.json"
    assert cli.main([*argv, "--via", "engine,loop", "--out", str(out)]) == 0  # a process for each
    res = json.loads(out.read_text())
    assert [r["via"] for r in res["results"]] == ["engine", "loop"] and set(res["median_tok_s"]) == {"engine", "loop"}
    for r in res["results"]:
        assert r["output_tokens"] == requested
        # Each step samples at most one token per client; prompts and decodes fill every step's rows.
        assert requested / 3 <= r["steps"] <= requested
        assert r["tokens_per_step"] >= r["decode_rows_per_step"] > 0
        assert r["model_s"] > 0 and r["cpu"]["threads"]
    # The serving thread's name, shared with the OpenMP workers it starts; the readers' thread.
    threads = {t["thread"]: t for t in res["results"][1]["cpu"]["threads"]}
    assert "orca-engine" in threads and threads["asyncio-readers"]["cpu_s"] > 0

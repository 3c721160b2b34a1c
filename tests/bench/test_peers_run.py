"""benchmarks/peers/run.py without vLLM: its arguments, the engine limits both systems get, and
the rules that keep a table honest (earlier results reused only under the same settings, both
systems on the very same requests). A whole run needs vLLM's own venv (`make bench-peers`; its
`--smoke` mode takes about ten minutes), so it is not part of the tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from orcaserve.bench.peers import parts, run

REPO = Path(__file__).resolve().parents[2]


def test_arguments():
    args = run.parse_args(["--smoke", "--work", "/tmp/x", "--systems", "vllm", "--repeats", "2"])
    assert args.work == "/tmp/x" and args.workloads == ["offline", "http"]  # --work is not --workloads
    assert args.systems == ["vllm"] and args.dtypes == ["fp32", "bf16", "gguf"] and args.repeats == 2
    assert (args.num_prompts, args.num_requests) == (16, 16)
    for bad in (["--systems", "tgi"], ["--dtypes", "fp16"], ["--workloads", ""]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


def test_both_systems_get_the_same_engine_limits(tmp_path):
    args = argparse.Namespace(num_prompts=7, seed=3)
    flags = parts.offline_flags(args, "bf16", tmp_path / "o.json")
    limits = dict(zip(flags[::2], flags[1::2], strict=True))
    assert limits == {
        "--dtype": "bf16",
        "--num-prompts": "7",
        "--max-num-seqs": "32",
        "--max-num-batched-tokens": "512",
        "--max-model-len": "1024",
        "--seed": "3",
        "--out": str(tmp_path / "o.json"),
    }
    args.token_ids, args.num_requests, args.concurrency, args.warmup, args.systems = (
        (100, 49152),
        9,
        4,
        1,
        ["orcaserve"],
    )
    args.warmup_load, args.models = 0, ["smollm2"]
    settings = run.settings_of(args)
    assert settings["engine"] == parts.ENGINE_LIMITS and settings["vllm_env"] is None


def test_every_http_cell_runs_the_same_load(tmp_path, monkeypatch):
    """Each system's HTTP cell is `orcaserve-bench serve` with the same flags: the run's counts,
    the workload's shape, token ids and seed."""
    calls = []
    monkeypatch.setattr(parts, "run_logged", lambda cmd, *a, **k: calls.append(cmd))
    args = argparse.Namespace(concurrency=32, num_requests=16, token_ids=(100, 49152), seed=3, warmup=2, warmup_load=5)
    with pytest.raises(FileNotFoundError):  # nothing ran: no result to read
        parts.load_http(args, "vllm-x", "http://h/v1/completions", None, tmp_path, 4321, "x")
    flags = calls[0][calls[0].index("--endpoint") :]
    assert flags == [
        *("--endpoint", "http://h/v1/completions", "--key=none", "--model", "vllm-x", "--cpu-of=4321"),
        *("--concurrency", "32"),
        *("--num-requests", "16", "--input-len", "16:256", "--output-len", "8:128", "--token-range", "100:49152"),
        *("--seed", "3", "--warmup", "2", "--warmup-load", "5", "--timeout", "900"),
        *("--out", str(tmp_path / "vllm-x-http.json"), "--no-progress", "--model-name", "x"),
    ]


def _entry(system: str, dtype: str, workload: str, sha: str = "s") -> dict:
    return {"system": system, "dtype": dtype, "workload": workload, "workload_sha256": sha}


def test_earlier_results_only_under_the_same_settings(tmp_path):
    out = tmp_path / "peers.json"
    settings = {"engine": {"a": 1}, "offline": {"b": 2}, "http": {"c": 3}}
    old = [_entry("vllm", "bf16", "http"), _entry("orcaserve", "bf16", "http"), _entry("vllm", "fp32", "http")]
    out.write_text(json.dumps({"settings": settings, "results": old}))
    args = argparse.Namespace(
        out=str(out), models=["smollm2"], systems=["orcaserve", "vllm"], dtypes=["fp32"], workloads=["http"]
    )
    assert run.earlier_results(args, settings) == old[:2]  # the cells this run redoes are dropped
    args.models = ["1b"]
    assert run.earlier_results(args, settings) == old  # another size: every earlier cell kept
    assert run.earlier_results(args, dict(settings, http={"c": 4})) == []
    args.out = str(tmp_path / "missing.json")
    assert run.earlier_results(args, settings) == []


def test_systems_must_have_run_the_same_requests():
    run.check_same_workloads([_entry("vllm", "bf16", "http"), _entry("orcaserve", "bf16", "http")])
    run.check_same_workloads(
        [_entry("vllm", "bf16", "http", "a"), dict(_entry("orcaserve", "bf16", "http", "b"), model="1b")]
    )
    with pytest.raises(SystemExit, match="different workloads"):
        run.check_same_workloads([_entry("vllm", "bf16", "http", "a"), _entry("orcaserve", "bf16", "http", "b")])


def test_each_cell_has_one_peer():
    """vLLM takes the checkpoints (fp32, bf16), llama.cpp the GGUF over HTTP; orcaserve runs every
    cell, the GGUF's offline ones (gguf, and gguf-a8(-bf16) with int8 activations) without a peer."""
    cells = [
        (s, w, d)
        for s in ("orcaserve", "vllm", "llamacpp")
        for w in ("offline", "http")
        for d in ("fp32", "bf16", "gguf", "gguf-a8", "gguf-a8-bf16")
    ]
    ran = {c for c in cells if parts.applies(*c)}
    assert {c for c in cells if c[0] == "orcaserve"} <= ran
    assert {c for c in ran if c[0] == "llamacpp"} == {("llamacpp", "http", "gguf")}
    assert {c for c in ran if c[0] == "vllm"} == {("vllm", w, d) for w in ("offline", "http") for d in ("fp32", "bf16")}


def test_int8_activations_reach_the_engine(tmp_path, monkeypatch):
    """gguf-a8 is the GGUF with `activations: int8`: the offline flags and the archive's overrides
    say so, and the engine's configuration accepts them."""
    from orcaserve.scheduler.config import EngineConfig

    calls = []
    monkeypatch.setattr(parts, "run_logged", lambda cmd, *a, **k: calls.append(cmd))
    args = argparse.Namespace(num_prompts=7, seed=3, token_ids=(100, 49152))
    model = run.MODELS["1b-q4_0"]
    with pytest.raises(FileNotFoundError):  # the offline run is not made: no result to read
        parts.orcaserve_offline(args, model, "gguf-a8", tmp_path)
    flags = calls[0][calls[0].index("--dtype") :]
    assert flags[:2] == ["--dtype", "fp32"] and model.orcaserve_model("gguf-a8") == str(model.gguf)
    assert flags[-4:] == ["--quantization", "gguf", "--activations", "int8"]
    options = parts.ENGINE_OPTIONS["gguf-a8"]
    assert EngineConfig(dtype=parts.TORCH_DTYPE["gguf-a8"], **options).activations == "int8"


def test_int8_activations_with_bf16_rows_reach_the_engine(tmp_path, monkeypatch):
    """gguf-a8-bf16 is gguf-a8 with dtype bf16: the offline run's --dtype, the archive's dtype."""
    from orcaserve.bench.serve import local as serve_local
    from orcaserve.scheduler.config import EngineConfig

    calls = []
    monkeypatch.setattr(parts, "run_logged", lambda cmd, *a, **k: calls.append(cmd))
    args = argparse.Namespace(num_prompts=7, seed=3, token_ids=(100, 49152))
    model = run.MODELS["1b-q4_0"]
    with pytest.raises(FileNotFoundError):
        parts.orcaserve_offline(args, model, "gguf-a8-bf16", tmp_path)
    flags = calls[0][calls[0].index("--dtype") :]
    assert flags[:2] == ["--dtype", "bf16"] and model.orcaserve_model("gguf-a8-bf16") == str(model.gguf)
    assert flags[-4:] == ["--quantization", "gguf", "--activations", "int8"]
    assert parts.ROW_DTYPE["gguf-a8"] == "fp32"  # the first cell keeps its fp32 rows
    config = EngineConfig(dtype=parts.TORCH_DTYPE["gguf-a8-bf16"], **parts.ENGINE_OPTIONS["gguf-a8-bf16"])
    assert (config.activations, config.resolved_dtype()) == ("int8", torch.bfloat16)
    archived = []

    class Stop(Exception):
        pass

    def archive(root, name, overrides, path):
        archived.append((overrides, path))
        raise Stop  # before TorchServe starts

    monkeypatch.setattr(serve_local, "orcaserve_archive", archive)
    with pytest.raises(Stop):
        parts.orcaserve_http(args, model, "gguf-a8-bf16", tmp_path)
    [(overrides, path)] = archived
    assert path == str(model.gguf) and overrides["dtype"] == "bfloat16"
    assert (overrides["quantization"], overrides["activations"]) == ("gguf", "int8")


def test_table_names_the_peer_of_each_cell():
    report = run.rep

    rows = [
        dict(_entry("orcaserve", "bf16", "http"), output_tok_s=200.0),
        dict(_entry("vllm", "bf16", "http"), output_tok_s=100.0),
        dict(_entry("orcaserve", "gguf", "http"), output_tok_s=300.0),
        dict(_entry("llamacpp", "gguf", "http"), output_tok_s=100.0),
    ]
    rows.append(dict(_entry("orcaserve", "gguf", "http"), output_tok_s=90.0, model="1b"))
    rows.append(dict(_entry("llamacpp", "gguf", "http"), output_tok_s=30.0, model="1b"))
    rows.append(dict(_entry("orcaserve", "gguf-a8", "http"), output_tok_s=150.0, model="1b"))
    rows.append(dict(_entry("orcaserve", "gguf-a8", "offline"), output_tok_s=160.0, model="1b"))
    rows.append(dict(_entry("orcaserve", "gguf-a8-bf16", "http"), output_tok_s=180.0, model="1b"))
    assert report.ratios(rows) == {
        "smollm2/http/bf16": 2.0,
        "smollm2/http/gguf": 3.0,
        "1b/http/gguf": 3.0,
        "1b/http/gguf-a8": 5.0,  # against llama.cpp's gguf cell
        "1b/http/gguf-a8-bf16": 6.0,  # that one too
    }
    text = report.markdown(
        {
            "results": rows,
            "ratios": report.ratios(rows),
            "settings": {
                "offline": {"num_prompts": 1},
                "http": {"num_requests": 1, "concurrency": 1},
                "engine": parts.ENGINE_LIMITS,
            },
            "date": "d",
            "machine": {"summary": "m"},
            "versions_summary": "v",
            "command": "c",
        }
    )
    assert "| smollm2 | http | gguf | 300.0 | llama.cpp | 100.0 | 3.00x |" in text
    assert "| smollm2 | http | bf16 | 200.0 | vLLM | 100.0 | 2.00x |" in text
    assert "| 1b | http | gguf | 90.0 | llama.cpp | 30.0 | 3.00x |" in text
    assert "| 1b | http | gguf-a8 | 150.0 | llama.cpp | 30.0 | 5.00x |" in text
    assert "| 1b | offline | gguf-a8 | 160.0 | - | - | - |" in text  # no peer offline
    assert "| 1b | http | gguf-a8-bf16 | 180.0 | llama.cpp | 30.0 | 6.00x |" in text
    assert "| smollm2 | http | gguf-a8 |" not in text  # llama.cpp's gguf cell alone makes no gguf-a8 row

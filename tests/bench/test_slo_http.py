"""Latency classes through a real TorchServe, driven by `orcaserve-bench slo-http`'s own client
and server (benchmarks/slo/over_http.py, servers.py) on a tiny model: the tenant's class
(`tenant_slo_class`, under `fair`) and the gateway's class header reach the engine (its per-class
counters on /metrics), an unknown class is a 400 naming it, and every request of the two-class
load is answered with its tokens."""

from __future__ import annotations

import argparse
import time

import openai_http
import pytest

from orcaserve.bench.models.tiny import TINY_VOCAB, tiny_model
from orcaserve.bench.slo.over_http import add_arguments, drive, summarize
from orcaserve.bench.slo.servers import CLASS_HEADER, MODEL, TENANT_HEADER, Orcaserve

pytestmark = pytest.mark.slow

TINY_ARGS = {"kv_cache_memory": "4MiB", "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
LOAD = ["--seconds", "3", "--rate", "2", "--flood", "2", "--short", "6", "--short-out", "4", "--long", "40"]
LOAD += ["--long-out", "6", "--policy", "fair", "--token-range", f"3:{TINY_VOCAB}", "--timeout", "120"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-src")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(LOAD)
    targets = {"ttft_ms": 600000, "tpot_ms": 600000}  # met by every request: the counts are exact
    with Orcaserve(args, targets, tmp_path_factory.mktemp("slo-http"), model=str(path), engine=TINY_ARGS) as s:
        yield s, args


def counts(ts, name: str) -> dict[str, float]:
    """{class: value} of a per-class counter on /metrics."""
    out = {}
    for line in ts.metrics().splitlines():
        if line.startswith(name + "{") and 'Class="' in line:
            out[line.split('Class="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_classes_reach_the_engine_over_http(server):
    server, args = server
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}

    def call(headers: dict):
        return openai_http.call(server.ts, MODEL, openai_http.COMPLETIONS, body, headers=headers)

    # The flood's tenant has no class; a request naming one in the header gets it whatever its tenant.
    assert call({TENANT_HEADER: "batch", CLASS_HEADER: "batch"}).status_code == 200
    r = call({TENANT_HEADER: "batch", CLASS_HEADER: "gold"})
    assert r.status_code == 400 and "'gold'" in r.json()["error"]["message"]

    run = drive(server, args, classes=True)
    interactive, batch = run["records"]["interactive"], run["records"]["batch"]
    assert interactive and batch
    for r in interactive + batch:
        assert r.error is None and r.output_tokens == r.max_tokens, r
    row = summarize(run, {"ttft": 600.0, "tpot": 600.0}, args.seconds)
    assert row["interactive"]["attainment"] == 1.0 and row["interactive"]["errors"] == 0

    # The worker emits its counters after a step: one more request (no class) so the last ones go out.
    assert call({TENANT_HEADER: "other"}).status_code == 200
    want = {"interactive": len(interactive), "batch": 1}
    deadline = time.time() + 30
    while (got := counts(server.ts, "orca_slo_requests_total")) != want:
        assert time.time() < deadline, (got, want)
        time.sleep(0.5)
    assert counts(server.ts, "orca_slo_good_total") == want

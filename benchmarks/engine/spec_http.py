"""Prompt lookup served over HTTP (`orcaserve-bench spec --http`), beside llama.cpp's server
speculating on the same GGUF file (`--peers llamacpp`, spec_peers.py): both sides served, both
speculating and not, the same prompts and `--max-tokens` (docs/speculative-decoding.md
"Benchmark"; dated runs in docs/performance-log.md).

    orcaserve-bench spec --http --clients 1 --sets copy --peers llamacpp

TorchServe, started by the HTTP benchmarks' one launcher (benchmarks/serve/local.py), serves two
archives of the model with the offline bench's engine settings (32 rows, prefix cache off,
`--dtype`, `--quantization`): `spec-off` without speculation and `spec-ngram` with prompt lookup
at `--num-speculative-tokens`. Each gets the chat prompts that llama.cpp's server gets, from the
same closed-loop clients over its OpenAI chat route (spec_peers.py), greedy; tokens are counted
from each answer's usage. For each set and client count two uncounted requests to each archive
first, as llama.cpp's server gets (the policy's step-cost model starts learning the load there), then
`--repeats` off/on pairs alternated (spec_pairs.py): each side's median, each pair's speed-up and
their median, and the answers' text compared (`same`). By CPU time: tokens per CPU second of the
whole server (every process of TorchServe's session: its frontend and both workers).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from orcaserve.bench.engine.spec_pairs import pairs, summary
from orcaserve.bench.engine.spec_peers import closed_loop, peer_table
from orcaserve.bench.serve.cpu_probe import CpuProbe

ARMS = ("off", "ngram")


def _archives(args: argparse.Namespace, work: Path) -> dict[str, str]:
    """arm -> the name of its archive in `work`'s model store, the engine set as the offline bench's."""
    from orcaserve.bench.serve.local import orcaserve_archive

    engine = {"max_num_seqs": 32, "enable_prefix_caching": False}
    engine.update({k: v for k, v in (("dtype", args.dtype), ("quantization", args.quantization)) if v is not None})
    lookup = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    settings = {"off": None, "ngram": lookup}
    return {
        arm: orcaserve_archive(work, f"spec-{arm}", {**engine, "speculative": settings[arm]}, args.model or "default")
        for arm in ARMS
    }


def _run(url: str, headers: dict, prompts: list[str], clients: int, n: int, args, probe: CpuProbe) -> dict:
    """One closed-loop run, with the tokens per CPU second of the server's processes."""
    before = probe.snapshot()
    run = closed_loop(url, prompts, clients, n, args.max_tokens, headers)
    cpu = CpuProbe.delta(before, probe.snapshot(), run["tokens"], run["wall_s"])["totals_s"]["server"]
    return {**run, "tok_cpu_s": run["tokens"] / max(cpu, 1e-9)}


def run_http(args: argparse.Namespace, sets: dict[str, list[str]]) -> dict:
    """Each set and client count: off/on pairs over HTTP; then llama.cpp's rows beside them."""
    from orcaserve.bench.serve.local import torchserve

    if args.method != "ngram":
        raise SystemExit("--http serves prompt lookup (--method ngram)")
    work = Path(tempfile.mkdtemp(prefix="orcaserve-spec-http-"))
    names = _archives(args, work)
    results: dict = {"model": args.model or "SmolLM2-135M-Instruct (default)", "method": "ngram", "served": "http"}
    rows: list[dict] = []
    results["runs"] = rows
    print(
        f"{'set':<6}{'clients':>8}{'off tok/s':>11}{'ngram tok/s':>13}{'speed-up':>10}{'pairs':>8}{'by CPU':>8}"
        f"{'same':>6}",
        file=sys.stderr,
    )
    with torchserve(work, list(names.values())) as ts:
        urls = {arm: ts.url(f"/predictions/{name}/1.0/v1/chat/completions") for arm, name in names.items()}
        probe = CpuProbe(ts.proc.pid if ts.proc else None)
        for name, prompts in sets.items():
            for clients in map(int, args.clients.split(",")):
                n = args.requests or max(4, clients)
                for arm in ARMS:  # warm-up, not counted: as many requests as llama.cpp's
                    closed_loop(urls[arm], prompts, clients, min(n, 2), args.max_tokens, ts.auth())
                offs: list[dict] = []
                ons: list[dict] = []
                for _ in range(args.repeats):
                    offs.append(_run(urls["off"], ts.auth(), prompts, clients, n, args, probe))
                    ons.append(_run(urls["ngram"], ts.auth(), prompts, clients, n, args, probe))
                off, on, paired = summary(offs), summary(ons), pairs(offs, ons)
                row = {
                    "set": name,
                    "clients": clients,
                    "requests": n,
                    "off_tok_s": round(off["tok_s"], 2),
                    "ngram_tok_s": round(on["tok_s"], 2),
                    "off_runs": off["runs"],
                    "ngram_runs": on["runs"],
                    "speedup": round(on["tok_s"] / off["tok_s"], 3),
                    "same_answers": off["all_outputs"] == on["all_outputs"],
                    "pairs": paired,
                }
                rows.append(row)
                print(
                    f"{name:<6}{clients:>8}{row['off_tok_s']:>11.1f}{row['ngram_tok_s']:>13.1f}{row['speedup']:>9.2f}x"
                    f"{paired['median']:>7.2f}x{paired['median_cpu']:>7.2f}x{str(row['same_answers']):>6}",
                    file=sys.stderr,
                )
        results["spec_metrics"] = [line for line in ts.metrics().splitlines() if line.startswith("orca_spec_")]
    if "llamacpp" in args.peers.split(","):
        results["peers"] = peer_table(args, sets, rows, who="orcaserve http")
    return results

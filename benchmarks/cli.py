"""`orcaserve-bench`: every benchmark the project reruns, one command with subcommands.

A subcommand is a module exposing `add_arguments(parser)` and `run(args) -> dict`; the dict is
the result, written by `--out FILE.json` with the machine, CPU kind, commit and command line
(result.py). Registering one is one line in SUBCOMMANDS. How to read the figures:
docs/benchmark-serving.md; current figures: docs/results.md; dated runs: docs/performance-log.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

from orcaserve.bench import result

# name -> (module, what it measures). The module is imported only when its subcommand runs.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("orcaserve.bench.offline", "offline throughput: the engine vs transformers' generate, one workload"),
    "serve": ("orcaserve.bench.serve_bench", "load generator: TTFT/TPOT/latency vs rate, TorchServe or any OpenAI URL"),
    "peers": ("orcaserve.bench.peers.run", "orcaserve vs vLLM's CPU backend and llama.cpp's server, offline and HTTP"),
    "baseline": ("orcaserve.bench.baseline.baseline_archive", "archive of the baseline: TorchServe's batching"),
    "fair": ("orcaserve.bench.fairness", "two tenants, one flooding: token shares and the quiet tenant's latency"),
    "prefix": ("orcaserve.bench.prefix_cache", "prefix caching on vs off, and a timing probe across tenants"),
    "kernels": ("orcaserve.bench.cpu_kernels", "CPU GEMMs (bf16/fp32 and quantized) against torch's, ms per call"),
    "host": ("orcaserve.bench.host_overhead", "host work per step on a stub device, sync vs async scheduling"),
    "quality": ("orcaserve.bench.int8_quality", "top-1 agreement and KL of int8 activations against the fp32 model"),
    "slo": ("orcaserve.bench.slo", "latency targets: interactive beside a flood, attainment and goodput vs fcfs"),
    "slo-http": ("orcaserve.bench.slo_http", "slo's workload over HTTP: orcaserve's classes vs vLLM's priority policy"),
    "tp": ("orcaserve.bench.tensor_parallel", "tensor parallel ranks vs one process: tok/s, collectives' share, RSS"),
    "gpu": ("orcaserve.bench.gpu", "the GPU check's steps (benchmarks/gpu_check.sh runs them in a time budget)"),
}


# This run's arguments: a subcommand made of steps imports only the chosen step (steps.py).
ARGV: list[str] = []


class _Out(argparse.Action):
    """`--out`; `--json` is its old spelling, accepted for one release with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--json":
            warnings.warn("--json is deprecated: use --out", FutureWarning, stacklevel=1)
        setattr(namespace, self.dest, values)


def add_out(parser: argparse.ArgumentParser, help: str = "write the result here (JSON)") -> None:
    """`--out FILE.json` (alias `--json`) on `parser`, unless the subcommand defines `--out` itself."""
    if "--out" not in parser._option_string_actions:
        parser.add_argument("--out", "--json", dest="out", action=_Out, default=None, help=help)


def command(subcommand: str) -> list[str]:
    """How to start `orcaserve-bench SUBCOMMAND` in a child process of this interpreter: the
    console script beside it (its folder, not the working directory, goes first on sys.path)."""
    script = Path(sys.executable).with_name("orcaserve-bench")
    return [str(script), subcommand] if script.exists() else [sys.executable, "-m", "orcaserve.bench.cli", subcommand]


def _module(name: str):
    return importlib.import_module(SUBCOMMANDS[name][0])


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (the others may need torch)."""
    p = argparse.ArgumentParser(
        prog="orcaserve-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, what) in SUBCOMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=what, description=what)
            continue
        mod = _module(name)
        sp = sub.add_parser(
            name, help=what, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_arguments(sp)
        add_out(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ARGV[:] = argv
    args = parser_for(argv).parse_args(argv)
    res = _module(args.subcommand).run(args)
    if getattr(args, "out", None):
        result.write(args.out, res, argv)
        print(f"wrote {args.out}", file=sys.stderr)
    return int(res.get("exit_code", 0)) if isinstance(res, dict) else 0


if __name__ == "__main__":  # `python -m orcaserve.bench.cli`: run the imported module, whose ARGV steps.py reads
    from orcaserve.bench import cli

    sys.exit(cli.main())

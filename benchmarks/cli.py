"""`orcaserve-bench`: every benchmark the project reruns, one command with subcommands.

A subcommand is a module exposing `add_arguments(parser)` and `run(args) -> dict`; the dict is
the result, written by `--out FILE.json` with the machine, CPU kind, commit and command line
(result.py). Registering one is one line in SUBCOMMANDS (a subcommand made of steps, `kernels`
and `gpu`: one line in its STEPS table, each step a module of the same shape; a module that serves
several steps reads `args.step`). How to read the figures:
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
    "offline": (
        "orcaserve.bench.engine.offline",
        "offline throughput: the engine vs transformers' generate, one workload",
    ),
    "serve": ("orcaserve.bench.serve.bench", "load generator: TTFT/TPOT/latency vs rate, TorchServe or any OpenAI URL"),
    "closed-loop": (
        "orcaserve.bench.engine.closed_loop",
        "the HTTP load's requests in-process, closed-loop clients: the engine alone and through its serving thread",
    ),
    "relay": (
        "orcaserve.bench.serve.relay_cpu",
        "the worker's asyncio thread per streamed token: the handler over scripted outputs, no model",
    ),
    "peers": ("orcaserve.bench.peers.run", "orcaserve vs vLLM's CPU backend and llama.cpp's server, offline and HTTP"),
    "baseline": ("orcaserve.bench.baseline.baseline_archive", "archive of the baseline: TorchServe's batching"),
    "fair": ("orcaserve.bench.fair.fairness", "two tenants, one flooding: token shares and the quiet tenant's latency"),
    "prefix": ("orcaserve.bench.engine.prefix_cache", "prefix caching on vs off, and a timing probe across tenants"),
    "kernels": ("", "CPU GEMMs (bf16/fp32 and quantized) against torch's, ms per call"),
    "host": ("orcaserve.bench.engine.host_overhead", "host work per step on a stub device, sync vs async scheduling"),
    "quality": (
        "orcaserve.bench.cpu.int8_quality",
        "top-1 agreement and KL of int8 activations against the fp32 model",
    ),
    "slo": ("orcaserve.bench.slo.slo", "latency targets: interactive beside a flood, attainment and goodput vs fcfs"),
    "slo-http": (
        "orcaserve.bench.slo.over_http",
        "slo's workload over HTTP: orcaserve's classes vs vLLM's priority policy",
    ),
    "latency": (
        "orcaserve.bench.engine.latency",
        "1, 2 and 4 streams offline and over HTTP: tok/s, ms per token, DRAM roof",
    ),
    "bitnet": (
        "orcaserve.bench.engine.bitnet_twin",
        "BitNet at the 2B4T shape: TQ2_0 / TQ1_0 against the same weights in bf16, offline; llama.cpp per format",
    ),
    "bitnet-head-quality": (
        "orcaserve.bench.cpu.bitnet_head_quality",
        "BitNet at the 2B4T shape: a Q6_K / Q8_0 lm_head against the F16 head, top-1, KL, logit error",
    ),
    "tp": (
        "orcaserve.bench.engine.tensor_parallel",
        "tensor parallel ranks vs one process: tok/s, collectives' share, RSS",
    ),
    "spec": (
        "orcaserve.bench.engine.speculative",
        "speculative decoding (prompt lookup) on vs off: copy-heavy, open-ended",
    ),
    "lora": (
        "orcaserve.bench.engine.lora",
        "LoRA adapters mixed in one step against the base model alone: tok/s, memory per adapter",
    ),
    "gpu": ("", "the GPU check's steps (benchmarks/gpu_check.sh runs them in a time budget)"),
}

# The steps of `kernels` and `gpu` (`orcaserve-bench gpu engine exact`): only the chosen step's
# module is imported (the GPU check's preflight must run where torch does not import).
STEPS: dict[str, dict[str, tuple[str, str]]] = {
    "kernels": {
        "gemm": ("orcaserve.bench.cpu.gemm", "bf16/fp32 GEMMs at SmolLM2's shapes, ms per call"),
        "quant": ("orcaserve.bench.cpu.gemm", "GGUF block-format GEMMs at Llama-3.2-1B's shapes, ms and GB/s"),
        "int8": ("orcaserve.bench.cpu.gemm", "int8-activation GEMMs vs bitwise quantized and bf16, GFLOP/s and peak"),
        "ternary": ("orcaserve.bench.cpu.gemm", "BitNet's ternary GEMM vs its twin and bf16 at 2B4T's shapes, GB/s"),
        "ternary-lut": ("orcaserve.bench.cpu.ternary_lut", "lookup-table ternary GEMMs (bitnet.cpp's TL2) vs vpdpbusd"),
        "gemv-copy": ("orcaserve.bench.cpu.gemv_copy", "bf16 decode, 1-4 streams, with and without the GEMV copy"),
        "lora": ("orcaserve.bench.cpu.lora_ops", "one step's LoRA update by part: the twin's GEMMs, mask, C++ op"),
    },
    "gpu": {
        "preflight": ("orcaserve.bench.gpu.preflight", "versions, GPU, API probes; whether the steps can run"),
        "engine": ("orcaserve.bench.gpu.engine", "engine on the GPU: exact (vs transformers), throughput, real model"),
        "kernels": ("orcaserve.bench.gpu.attention", "Triton attention: decode bandwidth, prefill TFLOP/s, split-K"),
        "graphs": ("orcaserve.bench.gpu.graphs", "CUDA graphs on vs off: decode step times, end to end, exactness"),
        "fused": ("orcaserve.bench.gpu.fused", "the decoder's fused Triton kernels vs the PyTorch ops they replace"),
        "lora": (
            "orcaserve.bench.gpu.lora",
            "the Triton LoRA shrink/expand: 16 adapters rank 16, GB/s, vs twin and base",
        ),
        "lora_engine": (
            "orcaserve.bench.gpu.lora_engine",
            "the engine with LoRA adapters on the Triton path vs the PyTorch twins: equal tokens, tok/s",
        ),
        "ternary": (
            "orcaserve.bench.gpu.ternary",
            "BitNet's Triton ternary GEMM at 2B4T's shapes: exact, GB/s, vs bf16",
        ),
        "spec": (
            "orcaserve.bench.gpu.spec",
            "prompt lookup on the GPU engine vs off, graphs on/off: equal outputs, one-stream tok/s",
        ),
        "startup": ("orcaserve.bench.gpu.startup_cost", "import, custom-op registration and engine start-up times"),
        "summary": ("orcaserve.bench.gpu.summary", "summary.json from the steps' results (gpu_check.sh)"),
    },
}

# This run's arguments (serve/bench.py records them).
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


def engine_overrides(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` pairs as engine arguments, each value read as YAML (`8`, `true`, `null`)."""
    import yaml

    return {k.strip(): yaml.safe_load(v) for k, _, v in (s.partition("=") for s in pairs)}


def command(subcommand: str) -> list[str]:
    """How to start `orcaserve-bench SUBCOMMAND` in a child process of this interpreter: the
    console script beside it (its folder, not the working directory, goes first on sys.path)."""
    script = Path(sys.executable).with_name("orcaserve-bench")
    return [str(script), subcommand] if script.exists() else [sys.executable, "-m", "orcaserve.bench.cli", subcommand]


def _module(args: argparse.Namespace):
    table = STEPS.get(args.subcommand)
    return importlib.import_module(table[args.step][0] if table else SUBCOMMANDS[args.subcommand][0])


def _add(sub, table: dict[str, tuple[str, str]], chosen, argv: list[str], steps=STEPS) -> None:
    """One parser per entry of `table`; only the chosen entry's module is imported and asked for
    its arguments (the others may need torch)."""
    for name, (module, what) in table.items():
        if not chosen(name):
            sub.add_parser(name, help=what, description=what)
        elif name in steps:
            sp = sub.add_parser(name, help=what, description=what)
            sub_steps = sp.add_subparsers(dest="step", required=True, metavar="STEP")
            _add(sub_steps, steps[name], lambda step: step in argv, argv, {})
        else:
            mod = importlib.import_module(module)
            sp = sub.add_parser(
                name, help=what, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
            )
            mod.add_arguments(sp)
            add_out(sp)


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: the chosen subcommand's (and step's) module is imported, no other."""
    p = argparse.ArgumentParser(
        prog="orcaserve-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    first = next((a for a in argv if not a.startswith("-")), None)
    _add(p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND"), SUBCOMMANDS, first.__eq__, argv)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ARGV[:] = argv
    args = parser_for(argv).parse_args(argv)
    res = _module(args).run(args)
    if getattr(args, "out", None):
        result.write(args.out, res, argv)
        print(f"wrote {args.out}", file=sys.stderr)
    return int(res.get("exit_code", 0)) if isinstance(res, dict) else 0


if __name__ == "__main__":  # `python -m orcaserve.bench.cli`: run the imported module, whose ARGV is read
    from orcaserve.bench import cli

    sys.exit(cli.main())

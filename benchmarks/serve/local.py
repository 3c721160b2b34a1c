"""The one TorchServe launcher of the HTTP benchmarks (serve, fair, slo-http, peers): archives of
orcaserve (any model, handler overrides) and of the request-level baseline built into a scratch
folder, served by a fresh TorchServe (free loopback ports, token auth, a job queue deep enough
for a flood), stopped whole after. `orcaserve-bench serve --start-torchserve` starts orcaserve
`smollm2` (with `--set` overrides) and the baseline `smollm2-baseline` (`--batch-size`,
`--max-batch-delay`) side by side, both at `--dtype` when given."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from orcaserve.bench.cli import engine_overrides
from orcaserve.bench.serve.harness import TorchServe, registered

ORCA, BASELINE = "smollm2", "smollm2-baseline"


def orcaserve_archive(work: Path, name: str, overrides: dict, model: str = "default") -> str:
    """orcaserve's archive `name` of `model` (default: the bundled SmolLM2) in `work`'s model store."""
    from orcaserve.handler.archive import build

    build(model, name, str(work / "model-store"), fmt="no-archive", overrides=overrides, force=True)
    return name


@contextmanager
def torchserve(work: Path, names: list[str], queue: int = 1000, extra: dict | None = None) -> Iterator[TorchServe]:
    """TorchServe serving the archives `names` of `work`'s model store, registered; its logs are
    printed if start-up fails. `extra`: more config.properties entries (they win)."""
    config = {"job_queue_size": str(queue), "default_response_timeout": "900", **(extra or {})}
    with registered(TorchServe(work / "ts", work / "model-store", extra_config=config), names) as ts:
        yield ts


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--start-torchserve: a TorchServe of its own for the run")
    g.add_argument("--start-torchserve", action="store_true", help="build both archives, serve them, stop after")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="orcaserve model-config override")
    g.add_argument("--batch-size", type=int, default=8, help="the baseline's batchSize")
    g.add_argument("--max-batch-delay", type=int, default=100, help="the baseline's maxBatchDelay (ms)")
    g.add_argument("--dtype", default=None, help="both systems' dtype (default: their shared rule)")
    g.add_argument("--workdir", default=None, help="TorchServe's scratch folder (default: a temporary one)")
    g.add_argument(
        "--ts-config", action="append", default=[], metavar="KEY=VALUE", help="TorchServe config.properties entry"
    )


@contextmanager
def started(args: argparse.Namespace) -> Iterator[tuple[str, str | None, int | None]]:
    """TorchServe serving `args.model` (default: both systems); yields its URL, inference key and
    session id (its launcher's pid, for the CPU breakdown)."""
    from orcaserve.bench.baseline.baseline_archive import build_archive

    work = Path(args.workdir or tempfile.mkdtemp(prefix="orcaserve-serve-"))
    args.model = args.model or [ORCA, BASELINE]
    overrides = engine_overrides(args.set)
    overrides.update({"dtype": args.dtype} if args.dtype else {})
    if ORCA in args.model:
        orcaserve_archive(work, ORCA, overrides)
    if BASELINE in args.model:
        build_archive(str(work / "model-store"), BASELINE, args.batch_size, args.max_batch_delay, dtype=args.dtype)
    print(f"== TorchServe in {work}", flush=True)
    extra = dict(s.partition("=")[::2] for s in args.ts_config)
    with torchserve(work, args.model, extra=extra) as ts:
        yield ts.url(""), ts.keys.get("inference"), ts.proc.pid if ts.proc else None

"""`orcaserve-bench serve --start-torchserve`: orcaserve and the request-level baseline side by side
in one TorchServe started for the run (free loopback ports, token auth, its own scratch folder),
then stopped. Archives: orcaserve `smollm2` (with `--set` overrides) and the baseline
`smollm2-baseline` (`--batch-size`, `--max-batch-delay`), both at `--dtype` when given."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ORCA, BASELINE = "smollm2", "smollm2-baseline"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--start-torchserve: a TorchServe of its own for the run")
    g.add_argument("--start-torchserve", action="store_true", help="build both archives, serve them, stop after")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="orcaserve model-config override")
    g.add_argument("--batch-size", type=int, default=8, help="the baseline's batchSize")
    g.add_argument("--max-batch-delay", type=int, default=100, help="the baseline's maxBatchDelay (ms)")
    g.add_argument("--dtype", default=None, help="both systems' dtype (default: their shared rule)")
    g.add_argument("--workdir", default=None, help="TorchServe's scratch folder (default: a temporary one)")


@contextmanager
def started(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """TorchServe serving `args.model` (default: both systems); yields its URL and inference key."""
    from orcaserve.bench.baseline.baseline_archive import build_archive
    from orcaserve.bench.harness import TorchServe
    from orcaserve.handler.archive import build

    work = Path(args.workdir or tempfile.mkdtemp(prefix="orcaserve-serve-"))
    store = work / "model-store"
    if not args.model:
        args.model = [ORCA, BASELINE]
    overrides = {k.strip(): yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)}
    if args.dtype:
        overrides["dtype"] = args.dtype
    if ORCA in args.model:
        build("default", ORCA, str(store), "no-archive", overrides=overrides, force=True)
    if BASELINE in args.model:
        build_archive(str(store), BASELINE, args.batch_size, args.max_batch_delay, dtype=args.dtype)
    print(f"== TorchServe in {work}", flush=True)
    with TorchServe(
        work / "ts", store, extra_config={"job_queue_size": "1000", "default_response_timeout": "900"}
    ) as ts:
        for name in args.model:
            ts.register(name)
        yield ts.url(""), ts.keys.get("inference")

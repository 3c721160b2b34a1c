"""Run TorchServe in the foreground; Ctrl-C stops it cleanly.

    python -m orcaserve.handler.serve --ts-config config.properties --model-store model-store

`torchserve --start --foreground` shares the terminal's process group with its JVM and workers,
so Ctrl-C interrupts all of them at once and each prints a KeyboardInterrupt traceback. Here
TorchServe runs in its own session and Ctrl-C (or SIGTERM) becomes one SIGTERM to that session:
the JVM runs its shutdown hook, and each worker's handler stops its engine loop and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence


def _stop(proc: subprocess.Popen, timeout: float) -> int:
    print("\nStopping TorchServe ...", flush=True)
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # workers outliving the JVM would keep the model in memory
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    print("TorchServe stopped.", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ts-config", default="config.properties")
    p.add_argument("--model-store", default="model-store")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds to wait for a clean stop")
    args, extra = p.parse_known_args(argv)
    torchserve = os.path.join(os.path.dirname(sys.executable), "torchserve")
    cmd = [
        torchserve,
        "--start",
        "--foreground",
        "--ncs",
        "--ts-config",
        args.ts_config,
        "--model-store",
        args.model_store,
        *extra,
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    # SIGTERM (e.g. from a process manager) takes the same path as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return _stop(proc, args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())

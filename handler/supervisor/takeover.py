"""A replacement worker: serves a dead worker's connection to TorchServe (see process.py).

It does what TorchServe's `model_service_worker.py` does after accepting the frontend's
connection, on the connection the supervisor hands over instead: load the model the way the
original LOAD message asked (same model directory, handler, batch size, GPU), then run the async
service loop on that socket. The frontend never sees a worker die.

    python -m orcaserve.handler.supervisor.takeover --sock-fd N --load JSON --metrics-config PATH
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="orcaserve replacement worker (started by the supervisor)")
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--load", required=True)
    p.add_argument("--metrics-config", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)  # as TorchServe's worker

    from ts.async_service import AsyncService
    from ts.model_service_worker import TorchModelServiceWorker

    from orcaserve.handler.supervisor import link as supervisor_link
    from orcaserve.handler.torchserve import socket_lock

    load = json.loads(args.load)
    msg = {
        "modelName": load["model_name"].encode(),
        "modelPath": load["model_dir"].encode(),
        "batchSize": int(load["batch_size"]),
        "handler": load["handler"].encode(),
        "envelope": b"",
        "limitMaxImagePixels": bool(load["limit_max_image_pixels"]),
    }
    if load.get("gpu") is not None and int(load["gpu"]) >= 0:
        msg["gpu"] = int(load["gpu"])
    # A TCP worker object that never binds: only its model loading and metrics cache are used
    # (a unix one would remove the frontend's socket path).
    worker = TorchModelServiceWorker("tcp", None, "127.0.0.1", 0, args.metrics_config, True)
    os.chdir(load["model_dir"])  # TorchServe starts workers in the model directory
    sock = socket.socket(fileno=args.sock_fd)
    sock.setblocking(True)
    socket_lock.install(sock)  # reads come from the supervisor's relay, frames are reported
    supervisor_link.SupervisorLink.attach(os.environ[supervisor_link.ENV]).attach_to_socket()
    service, result, code = worker.load_model(msg)
    if code != 200:
        logging.error("orcaserve replacement worker %d could not load the model: %s", os.getpid(), result)
        return 1
    service.set_cl_socket(sock)
    logging.info("orcaserve replacement worker %d serves %s", os.getpid(), load["model_name"])
    error = AsyncService(service).run()
    if error:
        logging.error("orcaserve replacement worker %d stopped: %s", os.getpid(), error)
    logging.shutdown()
    os._exit(1 if error else 0)  # TorchServe's service threads are not daemons


if __name__ == "__main__":
    sys.exit(main())

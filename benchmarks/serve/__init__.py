"""Serving over HTTP: the load generator (`orcaserve-bench serve`), its client, workloads and
report, and the TorchServe launcher and harness every HTTP benchmark and end-to-end test uses."""

"""Latency targets (`orcaserve-bench slo`, in one process; `orcaserve-bench slo-http`, over real
servers)."""

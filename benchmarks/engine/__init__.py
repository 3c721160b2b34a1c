"""The engine in one process, no server: offline throughput, host work per step, prefix caching,
tensor parallelism."""

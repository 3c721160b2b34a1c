"""Tensor parallelism: one model's layers split over several processes (docs/tensor-parallel.md)."""

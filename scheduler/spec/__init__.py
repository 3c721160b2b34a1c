"""Speculative decoding inside the iteration-level step (docs/speculative-decoding.md)."""

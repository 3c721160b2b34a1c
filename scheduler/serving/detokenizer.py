"""Re-export: the incremental detokenizer lives beside the engine (scheduler/detokenizer.py)."""

from orcaserve.scheduler.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]

"""What a proposer may read of the engine it proposes for (`SpecDecoding` builds it from the
engine): a draft model loads beside the target with the target's settings, checks its vocabulary
against the target's tokenizer and sizes its own KV pool from the target's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orcaserve.scheduler.config import EngineConfig


@dataclass(frozen=True)
class Target:
    config: EngineConfig  # the engine's (device, dtype, block size, rows and tokens per step)
    tokenizer: Any  # the target's tokenizer (a transformers tokenizer), None where there is none
    vocab_size: int  # the target's logits width
    max_model_len: int  # the longest sequence the engine serves
    num_blocks: int  # the target's KV pool, in blocks

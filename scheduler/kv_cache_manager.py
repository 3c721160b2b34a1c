"""Maps requests to their KV blocks: allocation per step, release on finish/abort/preemption."""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Request


class KVCacheManager:
    """Block tables of all requests that hold cache memory."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more cached tokens of `request`.

        Returns False, taking nothing, when the pool is short: the caller decides whom to preempt.
        """
        held = self._blocks.setdefault(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(held)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            if not held:
                del self._blocks[request.request_id]
            return False
        held.extend(new)
        return True

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks)

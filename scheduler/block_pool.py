"""Fixed pool of KV-cache blocks with a free list and reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference goes.

    Reference counts let several requests share a block (prefix sharing); today every block has
    one owner.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        # Freed blocks go to the back: the most recently used are reused last.
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

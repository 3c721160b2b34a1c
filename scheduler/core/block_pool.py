"""Fixed pool of KV-cache blocks: reference counts, an LRU list of free blocks, prefix-cache keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference goes.

    Prefix caching: a full block may carry a key (see `block_hash.py`). A freed block keeps its key
    and its K/V, so a later request with the same prefix can take it back (`touch`) instead of
    recomputing it; it stays reusable until `allocate` hands it out for other content, which drops
    its key. Free blocks are kept in least-recently-freed order (an OrderedDict: O(1) append, pop
    of the oldest, and removal from the middle when a cached block is hit), so eviction takes the
    block nobody has wanted for longest. A block with references is never handed out, so a block
    that is shared or cached is never overwritten.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks that still hold a key

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached ones included: all of them can be handed out."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted last-freed last)."""
        return self._num_cached_free

    @property
    def num_cached(self) -> int:
        """Blocks with a key, referenced or not."""
        return len(self._by_key)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def key_of(self, block: int) -> bytes | None:
        return self._key_of[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n blocks for new content, or None (and nothing taken) if fewer are free.

        Takes the least recently freed blocks; a cached one among them loses its key, since its
        slots are about to be overwritten."""
        if n > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            key = self._key_of[b]
            if key is not None:
                del self._by_key[key]
                self._key_of[b] = None
                self._num_cached_free -= 1
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more reference to blocks that are in use already."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; blocks that reach zero go to the back of the free list, in the
        order given (the first given is evicted first)."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._key_of[b] is not None:
                    self._num_cached_free += 1

    # ---- prefix cache ------------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        """The block cached under `key`, referenced or free, or None."""
        return self._by_key.get(key)

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit on the free list (taking them shrinks it)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), off the free list if they were free."""
        for b in blocks:
            if self._key_of[b] is None:
                raise RuntimeError(f"block {b} holds no cached prefix")
            if self._ref_counts[b] == 0:
                del self._free[b]
                self._num_cached_free -= 1
            self._ref_counts[b] += 1

    def register(self, block: int, key: bytes) -> bool:
        """Offer a full, in-use block to the cache under `key`.

        Returns False (the block stays uncached) when another block already holds the key: two
        requests that computed the same prefix in the same step. Keeping the first keeps block
        tables append-only; the duplicate is an ordinary block and is freed as one."""
        if self._ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free; only blocks in use can be cached")
        if self._key_of[block] is not None:
            return self._key_of[block] == key
        if key in self._by_key:
            return False
        self._by_key[key] = block
        self._key_of[block] = key
        return True

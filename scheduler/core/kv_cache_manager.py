"""Maps requests to their KV blocks: allocation per step, prefix-cache hits and registration,
release on finish/abort/preemption."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from orcaserve.scheduler.core.block_hash import extend_block_keys
from orcaserve.scheduler.core.block_pool import BlockPool
from orcaserve.scheduler.core.request import Request


class KVCacheManager:
    """Block tables of all requests that hold cache memory.

    With prefix caching, a request's full blocks are offered to the pool's cache after the step
    that filled them (`cache_full_blocks`), and a request being admitted starts from the longest
    run of cached blocks matching its tokens (`find_cached_prefix`). Writes only ever go to the
    slots of tokens at or after `num_computed_tokens`, which lie in blocks the request allocated
    itself and that are not yet cached; a cached block is therefore never written while keyed.
    Off unless asked for (the engine asks, from `EngineConfig.enable_prefix_caching`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Each request's block table as machine integers (int64): a step's tables are joined as
        # bytes, not read an int at a time (docs/host-overlap.md "Cheaper host work per request").
        self._blocks: dict[str, array[int]] = {}
        # Leading blocks of each request already offered to the cache (hits count as offered).
        self._num_offered: dict[str, int] = {}

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._blocks.get(request_id, ()))

    def tables_of(self, request_ids: Iterable[str]) -> list[array[int]]:
        """The block tables of requests that all hold blocks (a step's batch), in order; each an
        `array('q')` (its bytes are the int64 block ids), read-only to the caller."""
        return list(map(self._blocks.__getitem__, request_ids))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        return extend_block_keys(
            request.block_keys, request.all_token_ids, self.block_size, num_blocks, request.cache_salt, request.lora_key
        )

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold the longest prefix of `request`'s tokens; nothing is taken.

        At most the blocks before the one holding the last token: that token is always computed,
        since sampling needs its logits, and computing it writes its block, which must therefore
        be a fresh block of this request. A prompt that is entirely cached thus recomputes its last
        block (at most `block_size` tokens) instead of copying a shared block first (copy on
        write): the copy would cost a cache-to-cache copy in every layer, through the attention
        backends, to save at most one block of prefill.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for key in self._keys(request, (request.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def have_room(self, requests: Sequence[Request]) -> list[bool]:
        """For each request about to compute one more token: whether its last block has room for
        it, so that `allocate_slots(request, 1)` would take nothing (the decodes of a step, at once)."""
        get, size = self._blocks.get, self.block_size
        return [(held := get(r.request_id)) is not None and r.num_computed_tokens < len(held) * size for r in requests]

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more cached tokens of `request`.

        `cached` (only for a request that holds no blocks yet): blocks from `find_cached_prefix`
        that become the start of its block table, the new tokens following them. Returns False,
        taking nothing, when the pool is short: the caller decides whom to preempt.
        """
        held = self._blocks.get(request.request_id)
        if held is not None and not cached:  # the common case, a decode: room left in its last block?
            if request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
                return True
        else:
            held = self._blocks.setdefault(request.request_id, array("q"))
        if cached and (held or request.num_computed_tokens):
            raise RuntimeError(f"request {request.request_id} already holds blocks; cached blocks start a table")
        tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(tokens) - len(held) - len(cached)
        if need <= 0 and not cached:
            return True
        need = max(need, 0)
        # Cached blocks that sit on the free list shrink it when taken: count them against it.
        if need + self.pool.num_free_among(cached) > self.pool.num_free:
            if not held:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(cached)
        new = self.pool.allocate(need)
        assert new is not None  # checked above; touch() took only blocks counted there
        held.extend(cached)
        held.extend(new)
        if cached:
            self._num_offered[request.request_id] = len(cached)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the blocks `request` filled completely (after the step that computed them).

        Generated tokens' blocks are cached too: a preempted request finds them again, and so does
        a follow-up turn whose prompt repeats the answer."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        full = request.num_computed_tokens // self.block_size
        start = self._num_offered.get(rid, 0)
        if full <= start:  # every step but one in `block_size` of a decode: no block filled
            return
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        full = min(full, len(blocks))
        if full <= start:
            return
        keys = self._keys(request, full)
        for i in range(start, full):
            self.pool.register(blocks[i], keys[i])
        self._num_offered[request.request_id] = full

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        self._num_offered.pop(request.request_id, None)
        if blocks:
            # Last block first: it is evicted first, so a prefix stays usable longest from its start
            # (a later block is worthless once an earlier one is gone).
            self.pool.free(reversed(blocks))

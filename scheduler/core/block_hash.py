"""Prefix-cache keys of full KV blocks: SHA-256 chained over the block's parent, tokens and salt."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Tags keep the three kinds of preimage apart, so no first block can ever hash like a later one.
_FIRST_UNSALTED = b"\x00"
_FIRST_SALTED = b"\x01"
_CHILD = b"\x02"


def block_key(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    """The cache key of one full block.

    Chaining the parent's key makes equal keys mean equal content in equal context: a block's K/V
    depend on every token before it, not only on its own. The salt enters the first block only and
    so reaches every later one through the chain; requests with different salts never share a key.
    SHA-256 rather than Python's `hash()`: keys are compared, never their preimages, so a collision
    would silently serve another prompt's K/V; `hash()` is 64 bits and can be collided on purpose.
    The encoding is injective: fixed tag, length-prefixed salt, fixed-width token ids.
    """
    tokens = array("q", token_ids).tobytes()
    if parent is not None:
        head = _CHILD + parent
    elif salt is None:
        head = _FIRST_UNSALTED
    else:
        s = salt.encode("utf-8", "surrogatepass")
        head = _FIRST_SALTED + len(s).to_bytes(8, "little") + s
    return hashlib.sha256(head + tokens).digest()  # the preimage in one piece: one call into hashlib


def extend_block_keys(
    keys: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str | None
) -> list[bytes]:
    """Extend `keys` (the keys of the first blocks of `token_ids`) to `num_blocks` keys, in place.

    A request's keys are computed once and kept (`Request.block_keys`): its tokens never change,
    so each block is hashed once however often the request is looked up or preempted."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need more than {len(token_ids)} tokens")
    while len(keys) < num_blocks:
        i = len(keys)
        keys.append(block_key(keys[-1] if keys else None, token_ids[i * block_size : (i + 1) * block_size], salt))
    return keys

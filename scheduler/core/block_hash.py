"""Prefix-cache keys of full KV blocks: SHA-256 chained over the block's parent, tokens, salt and
LoRA adapter."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Tags keep the kinds of preimage apart, so no first block can ever hash like a later one.
_FIRST_UNSALTED = b"\x00"
_FIRST_SALTED = b"\x01"
_CHILD = b"\x02"
_FIRST_ADAPTED = b"\x03"  # under a LoRA adapter: its name, then the salt's tag and the salt


def _field(text: str) -> bytes:
    s = text.encode("utf-8", "surrogatepass")
    return len(s).to_bytes(8, "little") + s


def block_key(parent: bytes | None, token_ids: Sequence[int], salt: str | None, lora: str | None = None) -> bytes:
    """The cache key of one full block.

    Chaining the parent's key makes equal keys mean equal content in equal context: a block's K/V
    depend on every token before it, not only on its own. The salt and the LoRA adapter (whose
    update changes every layer's K/V: docs/lora.md "The prefix cache") enter the first block only
    and so reach every later one through the chain; requests with different salts or adapters
    never share a key, and a request of the base model (no adapter) keeps the keys it had before
    adapters existed. SHA-256 rather than Python's `hash()`: keys are compared, never their
    preimages, so a collision would silently serve another prompt's K/V; `hash()` is 64 bits and
    can be collided on purpose. The encoding is injective: fixed tags, length-prefixed strings,
    fixed-width token ids.
    """
    tokens = array("q", token_ids).tobytes()
    if parent is not None:
        head = _CHILD + parent
    else:
        head = _FIRST_UNSALTED if salt is None else _FIRST_SALTED + _field(salt)
        if lora is not None:
            head = _FIRST_ADAPTED + _field(lora) + head
    return hashlib.sha256(head + tokens).digest()  # the preimage in one piece: one call into hashlib


def extend_block_keys(
    keys: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    salt: str | None,
    lora: str | None = None,
) -> list[bytes]:
    """Extend `keys` (the keys of the first blocks of `token_ids`) to `num_blocks` keys, in place.

    A request's keys are computed once and kept (`Request.block_keys`): its tokens never change,
    so each block is hashed once however often the request is looked up or preempted."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need more than {len(token_ids)} tokens")
    while len(keys) < num_blocks:
        i = len(keys)
        parent = keys[-1] if keys else None
        keys.append(block_key(parent, token_ids[i * block_size : (i + 1) * block_size], salt, lora))
    return keys

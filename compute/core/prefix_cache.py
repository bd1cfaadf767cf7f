"""Prefix caching: content keys for full KV blocks and an LRU of evictable ones.

A full block's key chains its parent's key with its own token ids, so equal
keys mean equal whole prefixes, not just equal blocks. Keys are blake2b
digests: stable across runs and processes (unlike ``hash()`` of a tuple).

Ownership story: the cache is one more holder of a block in the
BlockAllocator's eyes. When the last sequence lets go of a cached block, the
manager *parks* it here instead of freeing it: it keeps one allocator
reference (the cache's), and is reused on a hit or evicted, least recently
used first, only when a fresh block is needed and none is free.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict

BlockKey = bytes


def block_key(parent: BlockKey | None, token_ids: list[int]) -> BlockKey:
    """Stable key of a full block given its parent block's key (None for the first)."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":  # hash the same bytes on every machine
        ids.byteswap()
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(ids.tobytes())
    return h.digest()


class PrefixCache:
    """key -> block map over full blocks, plus the LRU list of parked ones."""

    def __init__(self) -> None:
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # parked blocks, oldest first

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def lookup(self, key: BlockKey) -> int | None:
        return self._block_of.get(key)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._lru

    def register(self, key: BlockKey, block_id: int) -> bool:
        """Publish a newly full block; False if that prefix is already cached elsewhere."""
        if key in self._block_of:
            return False  # same content computed twice: keep the first copy
        if block_id in self._key_of:
            raise ValueError(f"block {block_id} is already cached under another key")
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        return True

    def park(self, block_id: int) -> None:
        """The last sequence let go of a cached block: keep it, as the newest evictable."""
        if block_id not in self._key_of:
            raise ValueError(f"block {block_id} is not cached; free it instead")
        if block_id in self._lru:
            raise ValueError(f"block {block_id} is already parked")
        self._lru[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A hit on a parked block: a sequence takes over the cache's reference."""
        if block_id not in self._lru:
            raise ValueError(f"block {block_id} is not parked")
        del self._lru[block_id]

    def evict(self) -> int | None:
        """Forget the least recently used parked block and hand it (and its reference) out."""
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        del self._block_of[self._key_of.pop(block_id)]
        return block_id

    def parked_blocks(self) -> list[int]:
        """Parked blocks in eviction order (for tests and invariant checks)."""
        return list(self._lru)

    def check_invariants(self) -> None:
        if len(self._block_of) != len(self._key_of):
            raise RuntimeError("key map and block map differ in size")
        for key, block_id in self._block_of.items():
            if self._key_of.get(block_id) != key:
                raise RuntimeError(f"block {block_id} maps back to another key")
        if any(b not in self._key_of for b in self._lru):
            raise RuntimeError("a parked block is not cached")

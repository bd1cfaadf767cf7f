"""Prefix caching: content keys for full KV blocks and an LRU of evictable ones.

A full block's key chains its parent's key with its own token ids, so equal
keys mean equal whole prefixes, not just equal blocks. Keys are blake2b
digests: stable across runs and processes (unlike ``hash()`` of a tuple). A cache
salt (a tenant's namespace) is folded into the first block's key, so prompts of
different salts never share a block, however equal their tokens.

Ownership story: the cache is one more holder of a block in the
BlockAllocator's eyes. When the last sequence lets go of a cached block, the
manager *parks* it here instead of freeing it: it keeps one allocator
reference (the cache's), and is reused on a hit or evicted, least recently
used first, only when a fresh block is needed and none is free.

Every block it publishes or forgets is recorded in ``events`` (compute/core/kv_events.py),
what KV-event subscribers (a prefix-routing gateway) rebuild the cache from.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from compute.core.errors import FieldError
from compute.core.kv_events import KvEventLog

BlockKey = bytes
_SALT_TAG = b"cache_salt\0"
MAX_CACHE_SALT_CHARS = 256


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The salt a request's blocks are keyed under: its own ``salt`` (a client's, at most
    MAX_CACHE_SALT_CHARS, else FieldError naming ``cache_salt``) inside its ``tenant``'s
    namespace when it has one, so no salt reaches another tenant's blocks. None: the
    shared cache."""
    if salt and len(salt) > MAX_CACHE_SALT_CHARS:
        raise FieldError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
    if tenant:
        return f"{tenant}/{salt or ''}"
    return salt or None


def block_key(
    parent: BlockKey | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockKey:
    """Stable key of a full block given its parent block's key (None for the first).

    ``salt`` counts for the first block only (its children inherit it through the chain);
    a salted block hashes more bytes than any unsalted one, so the two never collide.
    """
    ids = array("q", token_ids)
    if sys.byteorder == "big":  # hash the same bytes on every machine
        ids.byteswap()
    h = hashlib.blake2b(parent or b"", digest_size=16)
    if parent is None and salt:
        h.update(_SALT_TAG + salt.encode("utf-8", "surrogatepass") + b"\0")
    h.update(ids.tobytes())
    return h.digest()


class PrefixCache:
    """key -> block map over full blocks, plus the LRU list of parked ones."""

    def __init__(self, events: KvEventLog | None = None) -> None:
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # parked blocks, oldest first
        # Off unless a consumer takes them (the step loop does when serving).
        self.events = events if events is not None else KvEventLog(enabled=False)

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

    def register(
        self,
        key: BlockKey,
        block_id: int,
        parent: BlockKey | None = None,
        token_ids: Sequence[int] = (),
        salt: str | None = None,
    ) -> bool:
        """Publish a newly full block; False if that prefix is already cached elsewhere.

        ``parent``, ``token_ids`` and ``salt`` (what ``key`` was made of) go to the event."""
        if key in self._block_of:
            return False  # same content computed twice: keep the first copy
        if block_id in self._key_of:
            raise ValueError(f"block {block_id} is already cached under another key")
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        self.events.stored(key, parent, list(token_ids), salt)
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
        self._forget(block_id)
        return block_id

    def flush(self) -> tuple[list[int], int]:
        """Forget every cached block: the parked ones are returned (with the cache's
        reference each, to be freed), the ones sequences hold are only unpublished (no
        later prompt finds them; their last holder frees them). Returns (parked blocks,
        number unpublished)."""
        parked = list(self._lru)
        self._lru.clear()
        parked_set = set(parked)
        held = [b for b in self._key_of if b not in parked_set]
        for block_id in parked + held:
            self._forget(block_id)
        return parked, len(held)

    def _forget(self, block_id: int) -> None:
        key = self._key_of.pop(block_id)
        del self._block_of[key]
        self.events.removed(key)

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

"""What the prefix cache published and withdrew: the records behind KV-event streams.

The prefix cache (compute/core/prefix_cache.py) appends one record to its ``KvEventLog``
for every full block it publishes (``BlockStored``) and every block it forgets
(``BlockRemoved``: evicted, or flushed); the engine hands the log's records to the step
loop after each step (``Engine.take_kv_events``), which passes them on with the step's
stats (``CacheUpdate`` in compute/core/messages.py). Gateways that route by prefix
(SMG's event-driven index) rebuild each replica's cache from these, so they come from the
block manager itself, never from the requests.

A block's public hash is the first 8 bytes of its content key (a chained blake2b digest:
``prefix_cache.block_key``) as a signed int64, the protocol's ``block_hash``; the parent
hash is its parent block's, so a stored chain names the prefix it continues.
"""

from __future__ import annotations

from dataclasses import dataclass


def public_hash(key: bytes) -> int:
    """The signed int64 a block key is published as (first 8 bytes, little-endian)."""
    return int.from_bytes(key[:8], "little", signed=True)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block entered the prefix cache: later prompts with its prefix may reuse it."""

    block_hash: int
    parent_hash: int | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]
    cache_salt: str | None = None  # the salt its chain was keyed under (the first block's)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block left the prefix cache (evicted for a new block, or flushed)."""

    block_hash: int


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Everything a subscriber knew of the cache is void (the first event of a snapshot, or
    after events were lost); the blocks stored after it are all there is."""


KvEvent = BlockStored | BlockRemoved | CacheCleared


class KvEventLog:
    """The events since the last ``take``; ``enabled=False`` records nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[KvEvent] = []

    def stored(
        self, key: bytes, parent: bytes | None, token_ids: list[int], salt: str | None
    ) -> None:
        if self.enabled:
            parent_hash = None if parent is None else public_hash(parent)
            self._events.append(BlockStored(public_hash(key), parent_hash, tuple(token_ids), salt))

    def removed(self, key: bytes) -> None:
        if self.enabled:
            self._events.append(BlockRemoved(public_hash(key)))

    def take(self) -> tuple[KvEvent, ...]:
        """Every event recorded since the last call, oldest first."""
        if not self._events:
            return ()
        events, self._events = tuple(self._events), []
        return events

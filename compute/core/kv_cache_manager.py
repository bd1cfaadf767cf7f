"""Block tables of live sequences over the paged KV cache (vLLM v1-style verbs).

The scheduler asks: which prefix blocks can this waiting sequence reuse
(``get_computed_blocks``), can it grow by N tokens (``allocate_slots``, all or
nothing, False when it cannot), publish its newly full blocks
(``cache_full_blocks``), give everything back (``free``), move it to host
memory and back (``swap_out`` / ``swap_in``), and start it from another running
sequence's prompt (``fork``, n > 1); operators may drop the prefix cache (``flush``).
Pure bookkeeping, no tensors. What the prefix cache publishes and forgets is recorded
in ``kv_events`` for KV-event subscribers.

A fork shares only full blocks, which neither sequence ever writes again (both write
at positions past them); the block its own writes land in is a fresh copy.

Every device block is exactly one of: free (on the allocator's free list),
parked (cached, no sequence holds it, evictable; the cache holds its one
reference), or owned (reference count == number of live block tables that
contain it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from compute.core.block_allocator import BlockAllocator
from compute.core.kv_events import KvEventLog
from compute.core.prefix_cache import BlockKey, PrefixCache, block_key
from compute.core.sequence import Sequence


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.host_allocator = BlockAllocator(num_host_blocks)
        # What the prefix cache publishes and forgets; off until a consumer turns it on
        # (without prefix caching it stays empty).
        self.kv_events = KvEventLog(enabled=False)
        self.prefix_cache = PrefixCache(self.kv_events) if enable_prefix_caching else None
        self._keys: dict[str, list[BlockKey]] = {}  # per request: keys of its full blocks
        self._num_registered: dict[str, int] = {}  # per request: leading blocks already cached
        self._host_tables: dict[str, list[int]] = {}  # per swapped request: its host blocks
        self.prefix_hit_tokens = 0  # cumulative tokens served by the prefix cache

    # -- capacity -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can get: free plus parked (evictable) ones."""
        parked = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.allocator.num_free + parked

    @property
    def num_owned_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by live sequences (parked cache blocks count as free)."""
        return self.num_owned_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def room_for(self, seq: Sequence, reserve: int = 0, computed_blocks: Seq[int] = ()) -> int:
        """How many more tokens ``seq`` could take (with ``computed_blocks``, admission
        only) while ``reserve`` blocks stay free: what ``allocate_slots`` would grant."""
        parked_hits = sum(1 for b in computed_blocks if self._is_parked(b))
        fresh = self.num_free_blocks - parked_hits - reserve
        held = len(seq.block_ids) + len(computed_blocks)
        done = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(0, (held + fresh) * self.block_size - done)

    # -- allocation ---------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of ``seq`` and the number of tokens they cover.

        At least one token is left to compute so the step has logits to sample
        from; a hit therefore stops at the last full block before the final token.
        """
        if self.prefix_cache is None or seq.block_ids or seq.num_pending:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for key in self._block_keys(seq, max_blocks):
            block_id = self.prefix_cache.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()
    ) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more tokens; False if it cannot.

        ``computed_blocks`` (from get_computed_blocks, admission only) are shared,
        not copied. On failure nothing changes.
        """
        if computed_blocks and (seq.block_ids or seq.num_computed_tokens):
            raise ValueError("computed_blocks: only for a sequence that holds no blocks yet")
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens += num_new_tokens
        num_fresh = self.blocks_needed(num_tokens) - len(seq.block_ids) - len(computed_blocks)
        # Parked hits count as free, but taking them leaves fewer for fresh blocks.
        parked_hits = sum(1 for b in computed_blocks if self._is_parked(b))
        if num_fresh > self.num_free_blocks - parked_hits:
            return False
        self.prefix_hit_tokens += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            self._take(block_id)
        seq.block_ids.extend(computed_blocks)
        seq.block_ids.extend(self._allocate_block() for _ in range(num_fresh))
        if computed_blocks:
            self._num_registered[seq.request_id] = len(computed_blocks)
        return True

    def fork(
        self, seq: Sequence, parent: Sequence, num_tokens: int, num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Start ``seq`` (holding no blocks) with the K/V of ``parent``'s first
        ``num_tokens`` tokens, and room for ``num_new_tokens`` more; None if it cannot.

        ``parent``'s full blocks among them are shared (one more reference each); the
        partial one after them is copied into a fresh block: the returned (parent block,
        copy) pair, which the runner must copy before the step's forward. All or nothing.
        """
        if seq.block_ids or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: only a sequence holding no blocks can fork")
        if not 0 < num_tokens <= parent.num_computed_tokens:
            raise ValueError(f"{parent.request_id}: has not computed {num_tokens} tokens")
        num_shared, partial = divmod(num_tokens, self.block_size)
        num_fresh = self.blocks_needed(num_tokens + num_new_tokens) - num_shared
        if num_fresh > self.num_free_blocks:
            return None
        shared = parent.block_ids[:num_shared]
        for block_id in shared:
            self.allocator.fork(block_id)  # owned by the running parent: never parked
        fresh = [self._allocate_block() for _ in range(num_fresh)]
        seq.block_ids = shared + fresh
        # The parent published the shared blocks (or found them published) already.
        self._num_registered[seq.request_id] = num_shared
        return [(parent.block_ids[num_shared], fresh[0])] if partial else []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that ``seq``'s computed tokens have filled since last time."""
        if self.prefix_cache is None:
            return
        # A block is keyed by its token ids, so one holding a pending placeholder waits.
        known = min(seq.num_computed_tokens, seq.num_known_tokens)
        num_full = min(known // self.block_size, len(seq.block_ids))
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        keys = self._block_keys(seq, num_full)
        size, salt = self.block_size, seq.cache_salt
        for i in range(start, num_full):
            tokens = seq.token_ids_slice(i * size, (i + 1) * size)
            parent = keys[i - 1] if i else None
            self.prefix_cache.register(keys[i], seq.block_ids[i], parent, tokens, salt)
        self._num_registered[seq.request_id] = num_full

    def flush(self) -> tuple[int, int]:
        """Drop the prefix cache: cached blocks no sequence holds are freed now, those that
        sequences hold are unpublished (no later prompt reuses them; freed with their last
        holder). Returns (blocks freed, blocks unpublished); each one's removal is an event."""
        if self.prefix_cache is None:
            return 0, 0
        parked, unpublished = self.prefix_cache.flush()
        for block_id in parked:
            self.allocator.free(block_id)  # the cache's reference was the only one
        return len(parked), unpublished

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks beyond what ``num_tokens`` tokens need: the slots of a
        rejected speculative draft. They hold no published block (only blocks full of
        computed tokens are published), so they go straight back to the free list."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_ids) > keep:
            self._release(seq.block_ids.pop())

    def free(self, seq: Sequence) -> None:
        """Give back every device and host block of ``seq`` (finish, abort, preemption)."""
        self._release_all(seq)
        for host_block in self._host_tables.pop(seq.request_id, ()):
            self.host_allocator.free(host_block)
        self._keys.pop(seq.request_id, None)
        self._num_registered.pop(seq.request_id, None)

    # -- swapping -----------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_allocator.num_free >= len(seq.block_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to host blocks; returns (device_block, host_block) copies.

        The device blocks are released at once, so the runner must perform these
        copies before the step's forward pass writes into them.
        """
        if seq.request_id in self._host_tables:
            raise ValueError(f"{seq.request_id} is already swapped out")
        if not self.can_swap_out(seq):
            raise ValueError(f"{seq.request_id}: not enough host blocks to swap out")
        host_blocks = [self.host_allocator.allocate() for _ in seq.block_ids]
        pairs = list(zip(seq.block_ids, host_blocks, strict=True))
        self._release_all(seq)
        self._host_tables[seq.request_id] = host_blocks
        # Fresh device blocks after swap-in get published again when full.
        self._num_registered.pop(seq.request_id, None)
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0, reserve: int = 0) -> bool:
        """Whether ``seq`` can come back and then grow by ``num_new_tokens``, leaving
        ``reserve`` blocks free."""
        host_blocks = self._host_tables.get(seq.request_id)
        if host_blocks is None:
            return False
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(len(host_blocks), need) <= self.num_free_blocks - reserve

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq`` back to fresh device blocks; returns (host_block, device_block) copies."""
        host_blocks = self._host_tables.get(seq.request_id)
        if host_blocks is None:
            raise ValueError(f"{seq.request_id} is not swapped out")
        if len(host_blocks) > self.num_free_blocks:
            raise ValueError(f"{seq.request_id}: not enough device blocks to swap in")
        del self._host_tables[seq.request_id]
        seq.block_ids = [self._allocate_block() for _ in host_blocks]
        for host_block in host_blocks:
            self.host_allocator.free(host_block)
        return list(zip(host_blocks, seq.block_ids, strict=True))

    # -- internals ----------------------------------------------------------

    def _block_keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        """Keys of ``seq``'s first ``num_blocks`` full blocks, memoised per request."""
        keys = self._keys.setdefault(seq.request_id, [])
        size = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            tokens = seq.token_ids_slice(i * size, (i + 1) * size)
            keys.append(block_key(keys[-1] if keys else None, tokens, seq.cache_salt))
        return keys[:num_blocks]

    def _is_parked(self, block_id: int) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.is_evictable(block_id)

    def _take(self, block_id: int) -> None:
        """A prefix hit: share an owned block, or take over a parked one's reference."""
        if self._is_parked(block_id):
            self.prefix_cache.unpark(block_id)
        else:
            self.allocator.fork(block_id)

    def _allocate_block(self) -> int:
        block_id = self.allocator.allocate()
        if block_id is None and self.prefix_cache is not None:
            block_id = self.prefix_cache.evict()  # its reference passes to the new owner
        if block_id is None:
            raise RuntimeError("out of KV blocks after the capacity check passed")
        return block_id

    def _release_all(self, seq: Sequence) -> None:
        # Tail first: a parked tail is useless without its prefix, so it should
        # be evicted before the blocks in front of it.
        for block_id in reversed(seq.block_ids):
            self._release(block_id)
        seq.block_ids = []

    def _release(self, block_id: int) -> None:
        cache = self.prefix_cache
        last_holder = self.allocator.ref_count(block_id) == 1
        if cache is not None and last_holder and cache.is_cached(block_id):
            cache.park(block_id)  # keep it for future hits instead of freeing it
        else:
            self.allocator.free(block_id)

    # -- checks -------------------------------------------------------------

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise RuntimeError unless every block is exactly free, parked or owned."""
        self.allocator.check_invariants()
        self.host_allocator.check_invariants()
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        refs, host_refs = self._count_holders(list(live_seqs))
        for block_id in range(self.num_blocks):
            self._check_block(block_id, refs[block_id])
        for block_id in range(self.host_allocator.num_blocks):
            if self.host_allocator.ref_count(block_id) != host_refs[block_id]:
                raise RuntimeError(f"host block {block_id}: ref count != holders")

    def _count_holders(self, live_seqs: list[Sequence]) -> tuple[Counter, Counter]:
        refs: Counter[int] = Counter()
        host_refs: Counter[int] = Counter()
        live_ids = {seq.request_id for seq in live_seqs}
        for seq in live_seqs:
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise RuntimeError(f"{seq.request_id}: a block appears twice in its table")
            host = self._host_tables.get(seq.request_id)
            if host is None and len(seq.block_ids) * self.block_size < seq.num_computed_tokens:
                raise RuntimeError(f"{seq.request_id}: block table shorter than its tokens")
            if host is not None and seq.block_ids:
                raise RuntimeError(f"{seq.request_id}: swapped out but holds device blocks")
            refs.update(seq.block_ids)
            host_refs.update(host or ())
        if set(self._host_tables) - live_ids:
            raise RuntimeError("host blocks held by a sequence that is gone")
        return refs, host_refs

    def _check_block(self, block_id: int, holders: int) -> None:
        parked = self._is_parked(block_id)
        if parked and holders:
            raise RuntimeError(f"block {block_id} is parked yet owned by {holders} sequences")
        count = self.allocator.ref_count(block_id)
        if count != holders + parked:
            raise RuntimeError(
                f"block {block_id}: ref count {count} != {holders} holders + {int(parked)} parked"
            )
        if count == 0 and self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
            raise RuntimeError(f"block {block_id} is free but still cached")

"""The prefix cache's events (stored, removed), flush and cache salts, on the block manager
itself: what KV-event subscribers rebuild a replica's cache from."""

from __future__ import annotations

import pytest

from compute.core.errors import FieldError
from compute.core.kv_cache_manager import KVCacheManager
from compute.core.kv_events import BlockRemoved, BlockStored, public_hash
from compute.core.prefix_cache import MAX_CACHE_SALT_CHARS, block_key, cache_namespace
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import Sequence

B = 4


def make_seq(rid: str, prompt: list[int], salt: str | None = None) -> Sequence:
    params = SamplingParams(max_tokens=8)
    return Sequence(rid, list(prompt), params, arrival_time=0.0, cache_salt=salt)


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit ``seq`` as the scheduler does, compute its whole prompt, publish its blocks."""
    blocks, hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - hit, blocks)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hit


def recording(num_blocks: int = 16) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, B)
    kv.kv_events.enabled = True
    return kv


def test_full_blocks_are_published_as_a_chain_with_their_tokens() -> None:
    kv = recording()
    prompt = list(range(2 * B + 1))
    admit(kv, make_seq("a", prompt))
    first, second = kv.kv_events.take()
    k0 = block_key(None, prompt[:B])
    k1 = block_key(k0, prompt[B : 2 * B])
    assert first == BlockStored(public_hash(k0), None, tuple(prompt[:B]), None)
    assert second == BlockStored(public_hash(k1), public_hash(k0), tuple(prompt[B : 2 * B]))
    assert kv.kv_events.take() == ()  # taken once


def test_a_hit_publishes_nothing_and_only_new_blocks_are_stored() -> None:
    kv = recording()
    prompt = list(range(2 * B + 1))
    admit(kv, make_seq("a", prompt))
    kv.kv_events.take()
    assert admit(kv, make_seq("b", prompt[: 2 * B] + list(range(100, 100 + B + 1)))) == 2 * B
    (stored,) = kv.kv_events.take()  # the one block "b" filled beyond the shared prefix
    assert stored.parent_hash == public_hash(block_key(block_key(None, prompt[:B]), prompt[B:8]))


def test_eviction_is_a_removal_of_the_published_hash() -> None:
    kv = recording(num_blocks=2)
    a = make_seq("a", list(range(B + 1)))
    admit(kv, a)
    kv.free(a)  # its full block parks in the cache; its partial one is freed
    (stored,) = kv.kv_events.take()
    b = make_seq("b", list(range(50, 50 + 2 * B)))  # needs both blocks: evicts a's
    assert kv.allocate_slots(b, b.num_tokens)
    assert kv.kv_events.take() == (BlockRemoved(stored.block_hash),)
    kv.check_invariants([b])


def test_nothing_is_recorded_unless_enabled() -> None:
    kv = KVCacheManager(16, B)
    admit(kv, make_seq("a", list(range(3 * B))))
    assert kv.kv_events.take() == ()
    no_cache = KVCacheManager(16, B, enable_prefix_caching=False)
    no_cache.kv_events.enabled = True
    admit(no_cache, make_seq("a", list(range(3 * B))))
    assert no_cache.kv_events.take() == ()


def test_flush_frees_parked_blocks_and_unpublishes_held_ones() -> None:
    kv = recording()
    done = make_seq("done", list(range(2 * B + 1)))
    running = make_seq("running", list(range(100, 100 + 2 * B + 1)))
    admit(kv, done)
    admit(kv, running)
    kv.free(done)
    stored = {e.block_hash for e in kv.kv_events.take()}
    free_before = kv.allocator.num_free
    assert kv.flush() == (2, 2)  # done's two parked blocks freed; running's two unpublished
    assert kv.allocator.num_free == free_before + 2
    assert {e.block_hash for e in kv.kv_events.take()} == stored  # every one removed
    assert kv.prefix_cache.num_cached == 0
    kv.check_invariants([running])
    again = make_seq("again", list(range(100, 100 + 2 * B + 1)))
    assert kv.get_computed_blocks(again) == ([], 0)  # nothing cached is found any more
    kv.free(running)  # its unpublished blocks go straight back to the free list
    assert kv.prefix_cache.num_evictable == 0 and kv.num_free_blocks == 16
    kv.check_invariants([])


def test_different_salts_never_share_a_block() -> None:
    kv = recording()
    prompt = list(range(3 * B + 1))
    admit(kv, make_seq("a", prompt, salt="tenant-a"))
    assert admit(kv, make_seq("b", prompt, salt="tenant-b")) == 0
    assert admit(kv, make_seq("c", prompt)) == 0  # the unsalted cache is another namespace
    assert admit(kv, make_seq("a2", prompt, salt="tenant-a")) == 3 * B  # its own: hits
    events = kv.kv_events.take()
    assert len(events) == 9  # three chains of three blocks, none shared
    assert [e.cache_salt for e in events[:3]] == ["tenant-a"] * 3
    assert len({e.block_hash for e in events}) == 9


def test_salt_keys_are_stable_and_leave_unsalted_keys_alone() -> None:
    assert block_key(None, [1, 2], None) == block_key(None, [1, 2], "")
    assert block_key(None, [1, 2]).hex() == "f59df9f51bfcb52f7ae49756810ec78b"  # as before
    assert block_key(None, [1, 2], "x") != block_key(None, [1, 2])
    parent = block_key(None, [1, 2], "x")
    assert block_key(parent, [3, 4], "x") == block_key(parent, [3, 4])  # the chain carries it


def test_cache_namespace_keeps_tenants_apart_and_bounds_the_salt() -> None:
    assert cache_namespace(None, None) is None and cache_namespace(None, "") is None
    assert cache_namespace(None, "s") == "s"
    assert cache_namespace("tenant-1", None) == "tenant-1/"
    assert cache_namespace("tenant-1", "s") == "tenant-1/s" != cache_namespace("tenant-2", "s")
    with pytest.raises(FieldError) as info:
        cache_namespace(None, "x" * (MAX_CACHE_SALT_CHARS + 1))
    assert info.value.field == "cache_salt"

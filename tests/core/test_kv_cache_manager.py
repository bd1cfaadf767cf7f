"""KVCacheManager and PrefixCache: allocation, prefix hits, LRU eviction, swapping."""

from __future__ import annotations

import pytest

from compute.core.kv_cache_manager import KVCacheManager
from compute.core.prefix_cache import PrefixCache, block_key
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import Sequence

B = 4


def make_seq(rid: str, prompt: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit ``seq`` the way the scheduler does, compute its whole prompt, publish blocks."""
    blocks, hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - hit, blocks)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hit


def test_block_key_is_stable_and_chained():
    assert block_key(None, [1, 2, 3]) == block_key(None, [1, 2, 3])
    assert block_key(None, [1, 2, 3]) != block_key(None, [1, 2, 4])
    parent = block_key(None, [9])
    assert block_key(parent, [1, 2, 3]) != block_key(None, [1, 2, 3])
    # Pinned value: keys must not change between runs or processes.
    assert block_key(None, [1, 2]).hex() == "f59df9f51bfcb52f7ae49756810ec78b"


def test_allocate_grows_on_demand_and_free_returns_all():
    kv = KVCacheManager(8, B)
    seq = make_seq("a", list(range(6)))
    assert kv.allocate_slots(seq, 6)
    assert len(seq.block_ids) == 2
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 2)  # fits in the second block
    assert len(seq.block_ids) == 2
    seq.num_computed_tokens = 8
    assert kv.allocate_slots(seq, 1)
    assert len(seq.block_ids) == 3
    assert kv.usage == pytest.approx(3 / 8)
    kv.check_invariants([seq])
    kv.free(seq)
    assert seq.block_ids == [] and kv.usage == 0
    kv.check_invariants([])


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(3, B, enable_prefix_caching=False)
    a = make_seq("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = make_seq("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)  # needs 2 blocks, 1 free
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.check_invariants([a, b])


def test_prefix_hit_shares_full_blocks_and_recomputes_the_tail():
    kv = KVCacheManager(16, B)
    prompt = list(range(3 * B + 1))
    a = make_seq("a", prompt)
    assert admit(kv, a) == 0
    b = make_seq("b", prompt[: 3 * B] + [999])
    blocks, hit = kv.get_computed_blocks(b)
    assert blocks == a.block_ids[:3] and hit == 3 * B
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks)
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert all(kv.allocator.ref_count(x) == 2 for x in a.block_ids[:3])
    assert kv.prefix_hit_tokens == 3 * B
    kv.check_invariants([a, b])


def test_full_prompt_hit_recomputes_last_block():
    kv = KVCacheManager(16, B)
    prompt = list(range(2 * B))  # exactly two full blocks
    admit(kv, make_seq("a", prompt))
    blocks, hit = kv.get_computed_blocks(make_seq("b", prompt))
    # Capped at num_tokens - 1, rounded down to a block: one block, B tokens recomputed.
    assert len(blocks) == 1 and hit == B


def test_one_token_prompt_never_hits():
    kv = KVCacheManager(16, 1)
    admit(kv, make_seq("a", [5]))
    assert kv.get_computed_blocks(make_seq("b", [5])) == ([], 0)


def test_diverging_prefix_stops_at_first_miss():
    kv = KVCacheManager(16, B)
    admit(kv, make_seq("a", list(range(3 * B + 1))))
    other = list(range(3 * B + 1))
    other[B] = 777  # second block differs, so the third cannot match either
    blocks, hit = kv.get_computed_blocks(make_seq("b", other))
    assert len(blocks) == 1 and hit == B


def test_generated_tokens_fill_blocks_that_get_cached():
    kv = KVCacheManager(16, B)
    a = make_seq("a", list(range(B - 1)))
    admit(kv, a)
    a.output_token_ids += [50, 51]  # generation crosses into the second block
    assert kv.allocate_slots(a, 2)
    a.num_computed_tokens += 2
    kv.cache_full_blocks(a)
    assert kv.prefix_cache.num_cached == 1
    b = make_seq("b", a.all_token_ids[:B] + [1, 2])
    assert kv.get_computed_blocks(b)[1] == B


def test_freed_cached_blocks_are_parked_then_revived_by_a_hit():
    kv = KVCacheManager(8, B)
    prompt = list(range(2 * B + 1))
    a = make_seq("a", prompt)
    admit(kv, a)
    full = a.block_ids[:2]
    kv.free(a)
    assert kv.usage == 0 and kv.num_free_blocks == 8
    assert kv.prefix_cache.parked_blocks() == [full[1], full[0]]  # tail first
    b = make_seq("b", prompt)
    assert admit(kv, b) == 2 * B
    assert b.block_ids[:2] == full
    assert kv.prefix_cache.num_evictable == 0
    kv.check_invariants([b])


def test_lru_eviction_order_and_free_blocks_first():
    kv = KVCacheManager(6, B)
    a = make_seq("a", list(range(3 * B)))
    b = make_seq("b", list(range(100, 100 + 2 * B)))
    admit(kv, a)
    admit(kv, b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)
    # LRU: a's blocks tail first, then b's tail first.
    parked = kv.prefix_cache.parked_blocks()
    assert parked == a_blocks[::-1] + b_blocks[::-1]
    assert kv.allocator.num_free == 1
    c = make_seq("c", list(range(500, 500 + 3 * B)))
    assert kv.allocate_slots(c, 3 * B)
    # The plain free block goes first, then the two least recently used parked ones.
    assert kv.allocator.num_free == 0
    assert c.block_ids[1:] == parked[:2]
    assert kv.prefix_cache.parked_blocks() == parked[2:]
    # a's first block survived, its tail did not: a hit now stops after one block.
    assert kv.get_computed_blocks(make_seq("a2", list(range(3 * B))))[1] == B
    kv.check_invariants([c])


def test_parked_hit_is_not_counted_as_free_for_the_same_allocation():
    kv = KVCacheManager(3, B)
    a = make_seq("a", list(range(2 * B + 1)))
    admit(kv, a)
    kv.free(a)  # 2 parked, 1 free
    b = make_seq("b", list(range(2 * B)) + [7] * (B + 1))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 2 * B
    # Needs 2 more blocks, only 1 left once the 2 parked hits are taken: must refuse.
    assert not kv.allocate_slots(b, b.num_tokens - hit, blocks)
    assert b.block_ids == [] and kv.prefix_cache.num_evictable == 2
    kv.check_invariants([b])


def test_disabled_prefix_caching_frees_blocks_outright():
    kv = KVCacheManager(8, B, enable_prefix_caching=False)
    prompt = list(range(2 * B + 1))
    a = make_seq("a", prompt)
    admit(kv, a)
    kv.free(a)
    assert kv.allocator.num_free == 8
    assert kv.get_computed_blocks(make_seq("b", prompt)) == ([], 0)
    assert kv.prefix_hit_tokens == 0


def test_same_content_computed_twice_keeps_the_first_copy():
    kv = KVCacheManager(8, B)
    prompt = list(range(B + 1))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    for seq in (a, b):  # both admitted before either published its blocks
        assert kv.allocate_slots(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
    assert kv.prefix_cache.lookup(block_key(None, prompt[:B])) == a.block_ids[0]
    kv.free(b)  # b's copy was never cached: straight back to the free list
    assert kv.prefix_cache.num_evictable == 0
    kv.check_invariants([a])


def test_check_invariants_catches_double_ownership():
    kv = KVCacheManager(4, B, enable_prefix_caching=False)
    a, b = make_seq("a", [1, 2]), make_seq("b", [3, 4])
    kv.allocate_slots(a, 2)
    kv.allocate_slots(b, 2)
    b.block_ids[0] = a.block_ids[0]  # a block table bug: two owners, one reference
    with pytest.raises(RuntimeError, match="ref count"):
        kv.check_invariants([a, b])


def test_check_invariants_catches_leak():
    kv = KVCacheManager(4, B)
    a = make_seq("a", [1, 2])
    kv.allocate_slots(a, 2)
    with pytest.raises(RuntimeError):
        kv.check_invariants([])  # a holds a block but is not live


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(4, B, num_host_blocks=4)
    a = make_seq("a", list(range(2 * B)))
    admit(kv, a)
    device = list(a.block_ids)
    assert kv.can_swap_out(a)
    out = kv.swap_out(a)
    assert [d for d, _ in out] == device and a.block_ids == []
    assert kv.host_allocator.num_free == 2 and kv.usage == 0
    kv.check_invariants([a])
    assert kv.can_swap_in(a, 1)
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in out]
    assert [d for _, d in back] == a.block_ids
    assert kv.host_allocator.num_free == 4
    kv.check_invariants([a])


def test_swap_out_refuses_without_host_blocks():
    kv = KVCacheManager(4, B, num_host_blocks=1)
    a = make_seq("a", list(range(2 * B)))
    admit(kv, a)
    assert not kv.can_swap_out(a)
    with pytest.raises(ValueError):
        kv.swap_out(a)
    assert len(a.block_ids) == 2


def test_can_swap_in_counts_growth():
    kv = KVCacheManager(3, B, enable_prefix_caching=False, num_host_blocks=4)
    a = make_seq("a", list(range(2 * B)))
    admit(kv, a)
    kv.swap_out(a)
    filler = make_seq("f", [1])
    kv.allocate_slots(filler, 1)
    assert kv.can_swap_in(a, 0)
    assert not kv.can_swap_in(a, 1)  # the next token needs a third block


def test_free_of_swapped_sequence_returns_host_blocks():
    kv = KVCacheManager(4, B, num_host_blocks=4)
    a = make_seq("a", list(range(B + 1)))
    admit(kv, a)
    kv.swap_out(a)
    kv.free(a)
    assert kv.host_allocator.num_free == 4
    kv.check_invariants([])


def test_prefix_cache_park_rules():
    cache = PrefixCache()
    with pytest.raises(ValueError):
        cache.park(3)
    assert cache.register(b"k", 3)
    assert not cache.register(b"k", 4)
    cache.park(3)
    with pytest.raises(ValueError):
        cache.park(3)
    assert cache.evict() == 3
    assert cache.lookup(b"k") is None and cache.evict() is None
    cache.check_invariants()


def test_swapped_in_blocks_are_published_again():
    kv = KVCacheManager(3, B, num_host_blocks=4)
    a = make_seq("a", list(range(2 * B + 1)))
    admit(kv, a)
    kv.swap_out(a)  # its two full blocks are parked
    filler = make_seq("f", [1] * (3 * B))
    assert kv.allocate_slots(filler, 3 * B)  # evicts both parked blocks
    kv.free(filler)
    assert kv.prefix_cache.num_cached == 0
    kv.swap_in(a)
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(make_seq("b", a.prompt_token_ids))[1] == 2 * B
    kv.check_invariants([a])

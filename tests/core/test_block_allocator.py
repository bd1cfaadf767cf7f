"""BlockAllocator: reference counts, free list, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.core.block_allocator import BlockAllocator


def test_allocate_until_empty_then_none():
    alloc = BlockAllocator(3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2]
    assert alloc.allocate() is None
    assert alloc.num_free == 0 and alloc.num_in_use == 3
    alloc.check_invariants()


def test_free_returns_block_and_reports_last_holder():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    assert alloc.ref_count(b) == 1
    assert alloc.free(b) is True
    assert alloc.ref_count(b) == 0
    assert alloc.num_free == 2
    alloc.check_invariants()


def test_double_free_raises():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(b)
    alloc.check_invariants()


def test_free_of_never_allocated_block_raises():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError):
        alloc.free(1)


@pytest.mark.parametrize("block_id", [-1, 2, 100])
def test_unknown_block_raises(block_id):
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="unknown block"):
        alloc.free(block_id)
    with pytest.raises(ValueError, match="unknown block"):
        alloc.fork(block_id)


def test_fork_shares_until_last_free():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.fork(b)
    alloc.fork(b)
    assert alloc.ref_count(b) == 3
    assert alloc.free(b) is False
    assert alloc.free(b) is False
    assert alloc.num_free == 1
    assert alloc.free(b) is True
    assert alloc.num_free == 2
    alloc.check_invariants()


def test_fork_of_free_block_raises():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="free"):
        alloc.fork(0)


def test_freed_blocks_are_reused_last():
    alloc = BlockAllocator(3)
    a = alloc.allocate()
    alloc.free(a)
    assert [alloc.allocate() for _ in range(3)] == [1, 2, a]


def test_zero_blocks_is_allowed_and_empty():
    alloc = BlockAllocator(0)
    assert alloc.allocate() is None
    alloc.check_invariants()


def test_check_invariants_catches_corruption():
    alloc = BlockAllocator(2)
    alloc.allocate()
    alloc._free.append(alloc._free[0])  # simulate a bug: a block on the free list twice
    with pytest.raises(RuntimeError):
        alloc.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "fork", "free"]), st.integers(0, 7))))
def test_random_ops_keep_counts_consistent(ops):
    alloc = BlockAllocator(8)
    model: dict[int, int] = {}  # block -> holders, the obvious reference model
    for op, i in ops:
        if op == "alloc":
            b = alloc.allocate()
            if len(model) == 8:
                assert b is None
            else:
                assert b not in model
                model[b] = 1
        elif op == "fork" and model:
            b = sorted(model)[i % len(model)]
            alloc.fork(b)
            model[b] += 1
        elif op == "free" and model:
            b = sorted(model)[i % len(model)]
            model[b] -= 1
            assert alloc.free(b) is (model[b] == 0)
            if not model[b]:
                del model[b]
        alloc.check_invariants()
        assert alloc.num_free == 8 - len(model)
        assert all(alloc.ref_count(b) == n for b, n in model.items())

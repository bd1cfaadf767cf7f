"""n > 1 forks in the scheduler and the KV cache manager, against the fake runner: a
request naming ``fork_of`` shares its running parent's full prompt blocks by reference,
gets a copy of the partial last one, and computes only the last prompt token; it falls
back to a normal admission whenever the parent cannot be forked; and no block is ever
free, leaked or written while shared."""

from __future__ import annotations

import pytest

from compute.core.kv_cache_manager import KVCacheManager
from compute.core.outputs import SchedulerOutput
from compute.core.sequence import Sequence, SequenceStatus
from tests.core.test_kv_cache_manager import admit, make_seq
from tests.core.test_scheduler import B, Harness, ids

PROMPT = [10 + i for i in range(10)]  # 2 full blocks of 4 and a partial one


class ForkHarness(Harness):
    """The scheduler harness, also checking that no step writes into a shared block."""

    def check(self, out: SchedulerOutput) -> None:
        super().check(out)
        assert_no_shared_block_written(self.sched.kv_manager, out)


def assert_no_shared_block_written(kv, out: SchedulerOutput) -> None:
    for item in out.scheduled:
        seq = item.seq
        first = seq.num_computed_tokens // kv.block_size
        last = (seq.num_computed_tokens + item.num_new_tokens - 1) // kv.block_size
        for block_id in seq.block_ids[first : last + 1]:
            assert kv.allocator.ref_count(block_id) == 1, f"{seq.request_id} writes a shared block"


def fork_of(h: Harness, parent: Sequence, rid: str, max_tokens: int = 4) -> Sequence:
    return h.add(
        rid, list(parent.prompt_token_ids), max_tokens=max_tokens, fork_of=parent.request_id
    )


def ref_count(h: Harness, block_id: int) -> int:
    return h.sched.kv_manager.allocator.ref_count(block_id)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_fork_shares_full_blocks_copies_the_partial_one_and_computes_one_token(prefix):
    h = ForkHarness(prefix=prefix)
    a = h.add("a", PROMPT, max_tokens=4)
    h.step()  # a's prompt, and its first token
    b = fork_of(h, a, "b")
    out = h.step()
    assert ids(out) == [("a", 1), ("b", 1)]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [ref_count(h, blk) for blk in b.block_ids[:2]] == [2, 2]
    assert out.blocks_to_copy == [(a.block_ids[2], b.block_ids[2])]
    assert b.block_ids[2] != a.block_ids[2] and ref_count(h, b.block_ids[2]) == 1
    assert b.num_cached_tokens == len(PROMPT) - 1
    assert h.sched.num_forked == 1 and h.sched.num_fork_fallbacks == 0
    h.run()
    assert h.tokens["a"] == h.tokens["b"] == h.reference(a)
    assert h.sched.kv_manager.usage == 0
    assert h.sched.kv_manager.allocator.num_free + h.sched.kv_manager.num_free_blocks > 0
    if not prefix:
        assert h.sched.kv_manager.allocator.num_free == h.sched.kv_manager.num_blocks


@pytest.mark.parametrize("prompt_len", [2, 4, 5, 8, 9, 11])
@pytest.mark.parametrize("prefix", [True, False])
def test_every_block_boundary_forks_right(prompt_len, prefix):
    """P - 1 on a block boundary needs no copy; P on one shares one block fewer (the
    last prompt token, which the fork writes, is in it)."""
    h = ForkHarness(prefix=prefix)
    prompt = [20 + i for i in range(prompt_len)]
    a = h.add("a", prompt, max_tokens=6)
    h.step()
    b = fork_of(h, a, "b", max_tokens=6)
    out = h.step()
    num_shared, partial = divmod(prompt_len - 1, B)
    assert b.block_ids[:num_shared] == a.block_ids[:num_shared]
    assert b.block_ids[num_shared] != a.block_ids[num_shared]
    want = [(a.block_ids[num_shared], b.block_ids[num_shared])] if partial else []
    assert out.blocks_to_copy == want
    assert ("b", 1) in ids(out)
    h.run()
    assert h.tokens["a"] == h.tokens["b"] == h.reference(a)
    assert h.sched.kv_manager.usage == 0


@pytest.mark.parametrize("prefix", [True, False])
def test_n_samples_compute_the_prompt_once_plus_one_token_each(prefix):
    h = ForkHarness(prefix=prefix)
    a = h.add("a", PROMPT, max_tokens=5)
    h.step()
    others = [fork_of(h, a, f"s{i}", max_tokens=5) for i in (1, 2)]
    h.run()
    # prompt + (n - 1) last prompt tokens + the 4 inputs after each first token
    assert h.runner.num_computed_tokens == len(PROMPT) + 2 + 3 * 4
    assert all(h.tokens[s.request_id] == h.tokens["a"] for s in others)
    assert [s.num_cached_tokens for s in others] == [len(PROMPT) - 1] * 2
    assert h.sched.num_forked == 2


def test_forks_of_forks_and_chained_shares_count_every_holder():
    h = ForkHarness(prefix=False)
    a = h.add("a", PROMPT, max_tokens=8)
    h.step()
    b = fork_of(h, a, "b", max_tokens=8)
    h.step()
    c = fork_of(h, b, "c", max_tokens=8)  # b's prompt is computed: it forks too
    out = h.step()
    assert out.blocks_to_copy == [(b.block_ids[2], c.block_ids[2])]
    assert [ref_count(h, blk) for blk in a.block_ids[:2]] == [3, 3]
    h.run()
    assert h.tokens["a"] == h.tokens["b"] == h.tokens["c"]
    assert h.sched.kv_manager.allocator.num_free == h.sched.kv_manager.num_blocks


# -- fallbacks: the parent cannot be forked ----------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_a_finished_parent_falls_back_to_a_normal_admission(prefix):
    h = ForkHarness(prefix=prefix)
    a = h.add("a", PROMPT, max_tokens=1)
    h.step()
    assert a.is_finished
    b = fork_of(h, a, "b")
    out = h.step()
    assert out.blocks_to_copy == []
    assert b.num_cached_tokens == (8 if prefix else 0)  # the prefix cache's full blocks
    assert ids(out) == [("b", len(PROMPT) - b.num_cached_tokens)]
    assert h.sched.num_forked == 0 and h.sched.num_fork_fallbacks == 1
    h.run()
    assert h.tokens["b"] == h.reference(b)


def test_an_aborted_parent_falls_back():
    h = ForkHarness(prefix=False)
    a = h.add("a", PROMPT, max_tokens=8)
    h.step()
    h.sched.abort("a")
    b = fork_of(h, a, "b")
    assert ids(h.step()) == [("b", len(PROMPT))]
    h.run()
    assert h.tokens["b"] == h.reference(b) and h.sched.num_fork_fallbacks == 1


def test_a_parent_still_computing_its_prompt_is_not_waited_for():
    h = ForkHarness(prefix=False, max_num_batched_tokens=4)
    a = h.add("a", PROMPT, max_tokens=3)
    h.step()  # a's first chunk of 4
    b = fork_of(h, a, "b", max_tokens=3)
    h.run()
    assert h.sched.num_forked == 0 and h.sched.num_fork_fallbacks == 1
    assert b.num_cached_tokens == 0
    assert h.tokens["a"] == h.tokens["b"] == h.reference(a)


def test_a_parent_with_another_prompt_is_not_forked():
    h = ForkHarness(prefix=False)
    h.add("a", PROMPT, max_tokens=3)
    h.step()
    b = h.add("b", PROMPT[:-1] + [99], max_tokens=3, fork_of="a")
    h.run()
    assert h.sched.num_fork_fallbacks == 1 and h.tokens["b"] == h.reference(b)


def test_a_parent_without_its_prompt_computed_falls_back():
    """b, ahead of a by priority, is admitted while a has not computed its prompt (a is
    waiting, or admitted behind b with a first chunk of what fits): b computes its own."""
    h = ForkHarness(num_blocks=7, prefix=False, policy="priority")
    old = h.add("old", 4, max_tokens=16)
    h.step()
    a = h.add("a", PROMPT, max_tokens=6, priority=1)
    b = h.add("b", PROMPT, max_tokens=2, fork_of="a")
    while b.status is SequenceStatus.WAITING:
        h.step()
        assert a.num_computed_tokens < len(PROMPT)
    assert h.sched.num_fork_fallbacks == 1 and b.num_cached_tokens == 0
    h.run()
    assert old.is_finished and h.tokens["b"] == h.reference(b) == h.tokens["a"][:2]


# -- the fork's life: aborts, preemption ------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("victim", ["a", "b"])
def test_aborting_either_side_mid_stream_leaves_the_other_whole(prefix, victim):
    h = ForkHarness(prefix=prefix)
    a = h.add("a", PROMPT, max_tokens=8)
    h.step()
    b = fork_of(h, a, "b", max_tokens=8)
    h.step()
    h.step()
    assert h.sched.abort(victim)
    h.run()
    survivor = b if victim == "a" else a
    assert h.tokens[survivor.request_id] == h.reference(survivor)
    kv = h.sched.kv_manager
    assert kv.usage == 0
    if not prefix:
        assert kv.allocator.num_free == kv.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False])
def test_forks_under_preemption_pressure_match_and_free_everything(mode, prefix):
    h = ForkHarness(
        num_blocks=9,
        num_host_blocks=12 if mode == "swap" else 0,
        prefix=prefix,
        preemption_mode=mode,
    )
    a = h.add("a", PROMPT, max_tokens=14)
    h.step()
    forks = [fork_of(h, a, f"s{i}", max_tokens=14) for i in (1, 2, 3)]
    h.run()
    assert h.sched.num_preemptions > 0
    assert h.sched.num_forked >= 1
    for seq in [a, *forks]:
        assert h.tokens[seq.request_id] == h.reference(a)
    kv = h.sched.kv_manager
    assert kv.usage == 0 and kv.host_allocator.num_free == kv.host_allocator.num_blocks
    if not prefix:
        assert kv.allocator.num_free == kv.num_blocks


# -- the KV cache manager's verb ------------------------------------------------


def test_fork_is_all_or_nothing_and_refuses_what_it_cannot_share():
    kv = KVCacheManager(4, B, enable_prefix_caching=False)
    parent = make_seq("a", PROMPT)
    admit(kv, parent)  # 3 blocks
    child = make_seq("b", PROMPT)
    assert kv.fork(child, parent, 9, 1) == [(parent.block_ids[2], child.block_ids[2])]
    assert child.block_ids[:2] == parent.block_ids[:2] and kv.allocator.num_free == 0
    kv.check_invariants([parent, child])
    late = make_seq("c", PROMPT)
    assert kv.fork(late, parent, 9, 1) is None  # no block for the copy: nothing taken
    assert late.block_ids == [] and kv.allocator.ref_count(parent.block_ids[0]) == 2
    assert kv.fork(make_seq("d", PROMPT), parent, 8, 0) == []  # on a boundary: no copy
    with pytest.raises(ValueError, match="has not computed"):
        kv.fork(make_seq("e", PROMPT), parent, 11, 1)
    with pytest.raises(ValueError, match="holding no blocks"):
        kv.fork(child, parent, 9, 1)
    kv.free(parent)
    assert kv.allocator.ref_count(child.block_ids[0]) == 2  # child and d still hold them

"""Speculative decoding in the scheduler: drafts, acceptance, rollback, against the fake
runner (no model, no torch), and the n-gram proposer alone."""

from __future__ import annotations

import itertools
import random

import pytest

from compute.core.config import SpeculativeConfig
from compute.core.messages import FinishReason
from compute.core.ngram import NgramIndex, max_draft, propose_ngram
from compute.core.sequence import SequenceStatus
from tests.core.test_scheduler import EOS, Harness

K = 4

# -- the n-gram proposer ------------------------------------------------------


def test_ngram_longest_match_wins_over_a_later_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 7, 8, 9, 5, 3, 6, 0, 2, 3]
    # suffix [2, 3] occurs at 1..2 (then 7, 8, 9); [3] alone last at 7 (then 6, 0, ...)
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 9]
    assert propose_ngram(tokens, 3, 1, 1) == [6]  # only 1-grams: the latest, one token
    assert propose_ngram(tokens, 3, 3, 3) == []  # [1, 2, 3] != [0, 2, 3]


def test_ngram_latest_of_equal_matches_and_draft_length():
    tokens = [4, 5, 1, 4, 5, 2, 4, 5]
    assert propose_ngram(tokens, 2, 2, 2) == [2, 4]  # latest [4, 5] is at 3..4
    assert propose_ngram(tokens, 10, 2, 2) == [2, 4, 5]  # up to the end of the sequence
    assert propose_ngram(tokens, 10, 3, 3) == []
    assert propose_ngram(tokens, 0, 1, 2) == []


def test_ngram_draft_grows_with_the_match():
    # A match of n tokens drafts at most 2n - 1: 1, 3, 5, ...
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 1, 2]
    assert propose_ngram(tokens, 8, 1, 1) == [3]
    assert propose_ngram(tokens, 8, 1, 2) == [3, 4, 5]
    assert propose_ngram(tokens, 8, 1, 3) == [3, 4, 5, 6, 7]
    assert propose_ngram(tokens, 2, 1, 3) == [3, 4]  # and never more than asked
    assert [max_draft(n) for n in (1, 2, 3, 4)] == [1, 3, 5, 7]


def test_ngram_no_match_short_or_empty():
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([], 4, 1, 3) == []
    assert propose_ngram([7], 4, 1, 3) == []
    assert propose_ngram([7, 7], 4, 1, 3) == [7]
    assert propose_ngram([7, 7, 7, 7], 2, 2, 3) == [7]  # match ending at 2, then one token


def test_ngram_against_brute_force():
    rng = random.Random(5)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert propose_ngram(tokens, k, lo, hi) == _brute(tokens, k, lo, hi), (tokens, lo, hi)


class _Growing:
    """A sequence's tokens as the index reads them (num_tokens, token_ids_slice)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]


def test_the_index_drafts_what_the_scan_drafts_as_a_sequence_grows():
    rng = random.Random(11)
    for _ in range(400):
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        index, seq = NgramIndex(lo, hi), _Growing()
        for _ in range(rng.randrange(1, 60)):
            seq.tokens.append(rng.randrange(rng.randrange(2, 7)))
            k = rng.randrange(0, 9)
            assert index.propose(seq, k) == propose_ngram(seq.tokens, k, lo, hi), (seq.tokens, k)


def test_the_index_reads_a_bounded_number_of_tokens_per_step_whatever_the_context():
    # A counting test, not a timing: the scan reads the whole context at every step; the
    # index reads each new token once, plus the suffix and the draft it returns.
    rng, index, seq = random.Random(3), NgramIndex(1, 5), _Growing()
    drafted = 0
    for step in range(6000):
        seq.tokens.append(rng.randrange(50))
        before = index.tokens_read
        draft = index.propose(seq, 8)
        drafted += bool(draft)
        # The new token once, the suffix (at most ngram_max), and the draft it returns.
        assert index.tokens_read - before <= 1 + min(5, step) + len(draft), step
    assert drafted > 1000  # matches were found: the draft part was exercised


def _brute(tokens, k, lo, hi):
    n = len(tokens)
    for size in range(hi, lo - 1, -1):
        if size >= n:
            continue
        suffix = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + min(k, 2 * size - 1)]
    return []


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_tokens=0)
    with pytest.raises(ValueError, match="min <= max"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="min <= max"):
        SpeculativeConfig(ngram_min=0)
    with pytest.raises(ValueError, match="max_batch"):
        SpeculativeConfig(max_batch=0)
    assert not SpeculativeConfig().enabled and SpeculativeConfig(method="ngram").enabled


# -- the scheduler with drafts ------------------------------------------------


class SpecHarness(Harness):
    """The scheduler harness with speculation on and an oracle proposer: the fake model's
    true continuation, wrong from index ``reject_at()`` on (K or more: all right)."""

    def __init__(self, reject_at=lambda: K, spec: SpeculativeConfig | None = None, **kw):
        super().__init__(**kw)
        self.sched.drafts.config = spec or SpeculativeConfig(method="ngram", num_tokens=K)
        self.sched.drafts.proposer = self.oracle
        self.reject_at = reject_at
        self.drafts: list[int] = []  # length of every draft proposed

    def oracle(self, seq, k: int) -> list[int]:
        context, draft = list(seq.all_token_ids), []
        for _ in range(k):
            draft.append(self.runner.token_for(context))
            context.append(draft[-1])
        j = self.reject_at()
        if j < len(draft):
            draft[j] = (draft[j] + 1) % self.runner.vocab_size
        self.drafts.append(len(draft))
        return draft

    def step(self):
        out = super().step()
        self.check_published_blocks()
        return out

    def check_published_blocks(self) -> None:
        """Every block a live sequence has published holds exactly its tokens' ids in the
        fake cache (a rejected draft token there would differ)."""
        kv = self.sched.kv_manager
        for seq in self.sched.running:
            tokens = seq.all_token_ids
            for i in range(kv._num_registered.get(seq.request_id, 0)):
                block = self.runner.device[seq.block_ids[i]]
                assert block == tokens[i * kv.block_size : (i + 1) * kv.block_size]


@pytest.mark.parametrize("accept", range(K + 1))
def test_acceptance_of_each_length_emits_that_many_plus_one(accept):
    h = SpecHarness(reject_at=lambda: accept)
    seq = h.add("a", 10, max_tokens=40)
    h.step()  # prefill: one token, no draft
    accepted = 0
    while not seq.is_finished:
        before = len(h.tokens["a"])
        out = h.step()
        [item] = out.scheduled
        draft = len(item.draft_token_ids)
        assert item.num_new_tokens == 1 + draft
        if accept > 0 or draft:  # (accept 0: pauses in drafting, see the next test)
            assert draft == min(K, 40 - before - 1)  # drafts never run past max_tokens
        assert len(h.tokens["a"]) - before == min(accept, draft) + 1
        accepted += min(accept, draft)
        if not seq.is_finished:  # the sequence is a decode again, its tail blocks trimmed
            assert seq.num_tokens - seq.num_computed_tokens == 1
            kv = h.sched.kv_manager
            needed = kv.blocks_needed(seq.num_computed_tokens), kv.blocks_needed(seq.num_tokens)
            assert needed[0] <= len(seq.block_ids) <= needed[1]
    assert h.tokens["a"] == h.reference(seq)
    assert h.finished == {"a": FinishReason.LENGTH}
    assert h.sched.drafts.num_accepted_tokens == accepted
    assert h.sched.drafts.num_draft_tokens == sum(h.drafts)
    assert h.sched.kv_manager.usage == 0


def test_wholly_rejected_drafts_back_off_doubling_and_an_accepted_token_resets():
    """After a draft of which nothing is accepted the sequence drafts nothing for 1, 2, 4,
    then MAX_DRAFT_BACKOFF decode steps; one accepted token resets the pause. Its tokens
    stay the reference's."""
    from compute.core.drafts import MAX_DRAFT_BACKOFF

    accept = iter([0] * 5 + [K] * 3 + [0] * 100)
    h = SpecHarness(reject_at=lambda: next(accept))
    seq = h.add("a", 10, max_tokens=80)
    h.step()  # prefill
    pattern = []  # per decode step: the draft's length (0: none)
    while not seq.is_finished:
        [item] = h.step().scheduled
        pattern.append(len(item.draft_token_ids))
    assert h.tokens["a"] == h.reference(seq)
    d = [i for i, n in enumerate(pattern) if n]
    pauses = [b - a - 1 for a, b in itertools.pairwise(d)]
    assert MAX_DRAFT_BACKOFF == 8
    # five rejected drafts, then three accepted ones (no pause after them), then rejected
    assert pauses[:8] == [1, 2, 4, 8, 8, 0, 0, 0]
    assert pauses[8:11] == [1, 2, 4]


def test_drafts_respect_max_tokens_budget_and_max_batch():
    h = SpecHarness(max_num_batched_tokens=3, spec=SpeculativeConfig(method="ngram", num_tokens=K))
    seq = h.add("a", 3, max_tokens=6)
    h.step()
    out = h.step()
    assert [len(i.draft_token_ids) for i in out.scheduled] == [2]  # budget 3 = 1 + 2
    h.run()
    assert h.tokens["a"] == h.reference(seq) and len(h.tokens["a"]) == 6
    assert max(h.drafts) <= 2
    # Near max_tokens the draft shrinks: never more tokens than the request may emit.
    h2 = SpecHarness()
    h2.add("b", 3, max_tokens=3)
    h2.run()
    assert h2.drafts == [1]  # after the first token: room for one draft + one token
    # More running sequences than max_batch: no drafts at all.
    h3 = SpecHarness(spec=SpeculativeConfig(method="ngram", num_tokens=K, max_batch=2))
    for rid in "abc":
        h3.add(rid, 5, max_tokens=8)
    h3.run()
    assert h3.drafts == [] and h3.sched.drafts.num_draft_tokens == 0


def test_penalized_requests_get_no_drafts():
    h = SpecHarness()
    seq = h.add("a", 5, max_tokens=8, params={"repetition_penalty": 1.2})
    h.run()
    assert h.drafts == [] and h.tokens["a"] == h.reference(seq)


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_stop_token_inside_the_accepted_run_ends_there(stop_at):
    h = SpecHarness()
    probe = h.add("probe", [11, 12, 13, 14, 15], max_tokens=8)
    h.run()
    ref = h.tokens["probe"]
    assert h.reference(probe) == ref
    # The same prompt, with the token emitted at index 1 + stop_at as a stop token: the
    # second step emits 5 tokens at once (all accepted), the stop among them.
    stop = ref[stop_at]
    assert stop not in ref[:stop_at]
    seq = h.add("s", [11, 12, 13, 14, 15], max_tokens=8, params={"stop_token_ids": [stop]})
    h.run()
    assert h.tokens["s"] == ref[: stop_at + 1]
    assert h.finished["s"] is FinishReason.STOP and seq.output_token_ids == ref[: stop_at + 1]
    assert h.sched.kv_manager.usage == 0


def test_eos_inside_the_accepted_run_ends_there():
    h = SpecHarness()
    h.runner.eos_after = 3
    seq = h.add("a", 6, max_tokens=20)
    h.run()
    assert h.tokens["a"] == h.reference(seq) and h.tokens["a"][-1] == EOS
    assert len(h.tokens["a"]) == 4 and h.finished["a"] is FinishReason.STOP


def test_logprobs_one_per_emitted_token():
    h = SpecHarness()
    h.add("a", 6, max_tokens=11, params={"logprobs": True})
    outs = []
    while h.sched.has_unfinished():
        sched_out = h.sched.schedule()
        outs += h.sched.update_from_output(sched_out, h.runner.execute(sched_out))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 11
    assert all(len(o.new_token_ids) == len(o.new_logprobs) == 1 for o in outs)
    assert [o.new_logprobs[0].token_id for o in outs] == tokens
    assert [o.num_output_tokens for o in outs] == list(range(1, 12))
    assert [o.finished for o in outs] == [False] * 10 + [True]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_many_requests_with_preemption_match_the_reference(mode):
    rng = random.Random(3)
    h = SpecHarness(
        reject_at=lambda: rng.randrange(K + 2),
        num_blocks=12,
        num_host_blocks=64 if mode == "swap" else 0,
        preemption_mode=mode,
        max_num_batched_tokens=16,
        spec=SpeculativeConfig(method="ngram", num_tokens=K, max_batch=32),
    )
    seqs = [
        h.add(f"r{i}", rng.randrange(3, 16), max_tokens=rng.randrange(10, 30)) for i in range(12)
    ]
    h.run(2000)
    assert h.sched.num_preemptions > 0
    for seq in seqs:
        assert h.tokens[seq.request_id] == h.reference(seq), seq.request_id
    assert 0 < h.sched.drafts.num_accepted_tokens < h.sched.drafts.num_draft_tokens
    assert h.sched.kv_manager.usage == 0


def test_prefix_hits_on_blocks_written_next_to_rejected_drafts():
    rng = random.Random(9)
    h = SpecHarness(reject_at=lambda: rng.randrange(K))  # every draft partly rejected
    a = h.add("a", [21, 22, 23, 24, 25, 26], max_tokens=30)
    h.run()
    # Its prompt + output again: every full block it published is a hit, and a hit on a
    # block holding a rejected draft token would change the fake model's tokens.
    b = h.add("b", a.prompt_token_ids + h.tokens["a"], max_tokens=10)
    h.run()
    assert b.num_cached_tokens >= 32
    assert h.tokens["b"] == h.reference(b)


def test_abort_mid_draft_frees_every_block():
    h = SpecHarness(reject_at=lambda: 2)
    h.add("a", 9, max_tokens=30)
    h.add("b", 7, max_tokens=30)
    h.step()
    h.step()
    out = h.sched.schedule()
    assert all(item.draft_token_ids for item in out.scheduled)
    runner_out = h.runner.execute(out)
    h.sched.abort("a")  # scheduled with a draft and run, not yet committed
    h.sched.update_from_output(out, runner_out)
    h.sched.kv_manager.check_invariants(h.sched.live_sequences())
    out = h.sched.schedule()
    runner_out = h.runner.execute(out)
    h.sched.commit(out)
    h.sched.abort("b")  # committed, its draft not yet resolved
    h.sched.resolve(out, runner_out)
    assert not h.sched.has_unfinished()
    assert h.sched.kv_manager.usage == 0
    h.sched.kv_manager.check_invariants([])


def test_batched_drafts_match_the_reference():
    for batch in (1, 2, 5, 16, 32):
        cycle = itertools.cycle(range(K + 1))
        h = SpecHarness(
            reject_at=lambda cycle=cycle: next(cycle),
            num_blocks=512,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            spec=SpeculativeConfig(method="ngram", num_tokens=K, max_batch=32),
        )
        seqs = [h.add(f"r{i}", 3 + i % 7, max_tokens=5 + i % 11) for i in range(batch)]
        h.run()
        for seq in seqs:
            assert h.tokens[seq.request_id] == h.reference(seq)
            assert seq.status is SequenceStatus.FINISHED
        assert h.sched.kv_manager.usage == 0


def test_wrong_count_of_more_tokens_is_an_error():
    h = SpecHarness()
    h.add("a", 6, max_tokens=20)
    h.step()
    out = h.sched.schedule()
    runner_out = h.runner.execute(out)
    runner_out.more_tokens["a"] = runner_out.more_tokens["a"] + [(5, None)]
    with pytest.raises(ValueError, match="accepted"):
        h.sched.update_from_output(out, runner_out)

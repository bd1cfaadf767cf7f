"""Scheduler behaviour, step by step, against the fake runner (no model, no torch)."""

from __future__ import annotations

import itertools

import pytest

from compute.core.config import CacheConfig, SchedulerConfig
from compute.core.messages import FinishReason
from compute.core.outputs import ModelRunnerOutput, SchedulerOutput
from compute.core.sampling_params import SamplingParams
from compute.core.scheduler import Scheduler
from compute.core.sequence import Sequence, SequenceStatus
from tests.support.fake_runner import FakeRunner, reference_tokens

B = 4
EOS = 2


class Harness:
    """A scheduler, a fake runner over the same blocks, and a fake clock."""

    def __init__(
        self,
        num_blocks: int = 64,
        num_host_blocks: int = 0,
        max_model_len: int = 256,
        prefix: bool = True,
        eos_rate: float = 0.0,
        **sched_kwargs,
    ) -> None:
        sched_kwargs.setdefault("max_num_batched_tokens", 64)
        self.ticks = itertools.count()
        self.sched = Scheduler(
            SchedulerConfig(**sched_kwargs),
            CacheConfig(block_size=B, enable_prefix_caching=prefix),
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            eos_token_ids=(EOS,),
            num_host_blocks=num_host_blocks,
            clock=lambda: float(next(self.ticks)),
        )
        self.runner = FakeRunner(
            num_blocks, B, num_host_blocks, eos_token_id=EOS, eos_rate=eos_rate
        )
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.arrivals = itertools.count()

    def add(self, rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw) -> Sequence:
        if isinstance(prompt, int):
            prompt = [10 + (hash(rid) + i) % 500 for i in range(prompt)]
        params = SamplingParams(max_tokens=max_tokens, **kw.pop("params", {}))
        seq = Sequence(rid, prompt, params, arrival_time=float(next(self.arrivals)), **kw)
        self.sched.add_request(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check(out)
        for o in self.sched.update_from_output(out, self.runner.execute(out)):
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o.finish_reason
        self.sched.kv_manager.check_invariants(self.sched.live_sequences())
        return out

    def check(self, out: SchedulerOutput) -> None:
        cfg = self.sched.config
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({s.seq.request_id for s in out.scheduled}) == len(out.scheduled)
        self.sched.kv_manager.check_invariants(self.sched.live_sequences())

    def run(self, max_steps: int = 500) -> int:
        for n in range(max_steps):
            if not self.sched.has_unfinished():
                return n
            self.step()
        raise AssertionError("requests did not finish")

    def reference(self, seq: Sequence) -> list[int]:
        return reference_tokens(seq.prompt_token_ids, seq.sampling_params, self.runner, (EOS,))


def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


# -- basics ------------------------------------------------------------------


def test_single_request_prefills_then_decodes_and_frees():
    h = Harness()
    seq = h.add("a", 10, max_tokens=3)
    assert ids(h.step()) == [("a", 10)]
    assert seq.status is SequenceStatus.RUNNING and len(h.tokens["a"]) == 1
    assert ids(h.step()) == [("a", 1)]
    assert ids(h.step()) == [("a", 1)]
    assert h.finished == {"a": FinishReason.LENGTH}
    assert seq.status is SequenceStatus.FINISHED and seq.block_ids == []
    assert h.tokens["a"] == h.reference(seq)
    assert not h.sched.has_unfinished() and h.sched.kv_manager.usage == 0
    assert h.sched.get("a") is None


def test_times_and_cached_tokens_are_recorded():
    h = Harness()
    seq = h.add("a", 6, max_tokens=2)
    h.step()
    assert seq.first_scheduled_time is not None and seq.first_token_time is not None
    assert seq.first_token_time > seq.first_scheduled_time
    assert seq.num_cached_tokens == 0


def test_empty_schedule_when_idle():
    h = Harness()
    out = h.step()
    assert out.is_empty and out.num_batched_tokens == 0


# -- budget, ordering, chunking ----------------------------------------------


def test_chunked_prefill_splits_long_prompt_over_steps():
    h = Harness(max_num_batched_tokens=8)
    seq = h.add("a", 30, max_tokens=2)
    chunks = []
    while "a" not in h.tokens:
        out = h.step()
        chunks.append(out.num_batched_tokens)
        if seq.num_computed_tokens < 30:
            assert "a" not in h.tokens  # mid-prefill chunks produce no output
    assert chunks == [8, 8, 8, 6]
    h.run()
    assert h.tokens["a"] == h.reference(seq)


def test_decodes_go_first_then_prefill_fills_the_budget():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", 4, max_tokens=10)
    h.step()  # a prefilled, now decoding
    h.add("b", 20, max_tokens=2)
    assert ids(h.step()) == [("a", 1), ("b", 7)]
    assert ids(h.step()) == [("a", 1), ("b", 7)]
    assert ids(h.step()) == [("a", 1), ("b", 6)]
    assert ids(h.step()) == [("a", 1), ("b", 1)]  # b decodes now too


def test_decodes_precede_running_prefill_chunks():
    # Under "priority" a high-priority prefill sorts ahead of a decode in the
    # running list; the decode must still be served first.
    h = Harness(max_num_batched_tokens=8, policy="priority")
    h.add("b", 2, max_tokens=6, priority=5)
    h.step()  # b decoding from now on
    h.add("a", 30, max_tokens=2, priority=0)
    assert ids(h.step()) == [("b", 1), ("a", 7)]
    assert [s.request_id for s in h.sched.running] == ["a", "b"]
    assert ids(h.step()) == [("b", 1), ("a", 7)]


def test_budget_smaller_than_decodes_serves_oldest_first():
    h = Harness(max_num_batched_tokens=2, max_num_seqs=4)
    for rid in "abc":
        h.add(rid, 1, max_tokens=4)
    h.run()
    assert set(h.finished) == {"a", "b", "c"}


def test_max_num_seqs_caps_running():
    h = Harness(max_num_seqs=2)
    for rid in "abcde":
        h.add(rid, 3, max_tokens=3)
    out = h.step()
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 3
    h.run()
    assert set(h.finished) == set("abcde")


def test_fcfs_head_of_line_is_not_overtaken():
    h = Harness(num_blocks=6, prefix=False)
    h.add("a", 8, max_tokens=4)
    h.step()  # a holds 2 of 6 blocks
    big = h.add("big", 20, max_tokens=1)  # needs 5 blocks: waits for a
    small = h.add("small", 1, max_tokens=1)  # would fit now, but must not overtake big
    while big.first_scheduled_time is None:
        assert small.first_scheduled_time is None
        h.step()
    h.run()
    assert small.first_scheduled_time > big.first_scheduled_time
    assert set(h.finished) == {"a", "big", "small"}


# -- preemption ---------------------------------------------------------------


def test_recompute_preemption_evicts_newest_and_it_resumes_first():
    h = Harness(num_blocks=4, prefix=False, max_num_batched_tokens=64)
    a = h.add("a", 4, max_tokens=8)  # needs 3 blocks at the end
    b = h.add("b", 4, max_tokens=8)
    h.step()  # both prefilled: 2 blocks used
    c = h.add("c", 1, max_tokens=1)  # newer than b: must wait behind it once b is preempted
    preempted = []
    for _ in range(40):
        out = h.step()
        preempted += out.preempted_request_ids
        if "b" in out.preempted_request_ids:
            assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
            assert h.sched.waiting[0] is b
            assert b.output_token_ids  # kept: recomputed as prompt + outputs
        if "c" in h.finished:
            break
    assert preempted and preempted[0] == "b" and "a" not in preempted
    assert b.first_scheduled_time < c.first_scheduled_time  # b got back in before c
    h.run()
    assert h.tokens["a"] == h.reference(a) and h.tokens["b"] == h.reference(b)
    assert h.sched.num_preemptions == len(preempted)
    assert h.sched.kv_manager.usage == 0


def test_preempted_sequence_resumes_before_newer_waiting():
    h = Harness(num_blocks=4, prefix=False)
    h.add("a", 4, max_tokens=8)
    b = h.add("b", 4, max_tokens=8)
    h.step()
    while "b" not in h.step().preempted_request_ids:
        pass
    assert h.sched.waiting[0] is b
    h.add("c", 1, max_tokens=2)
    assert h.sched.waiting[0] is b  # c queues behind the preempted b
    b_back = False
    while "c" not in h.finished:
        rids = [s.seq.request_id for s in h.step().scheduled]
        if "c" in rids and not b_back:
            assert "b" in rids and rids.index("b") < rids.index("c")
        b_back = b_back or "b" in rids
    h.run()
    assert h.tokens["b"] == h.reference(b)


def test_swap_preemption_copies_blocks_and_swaps_back():
    h = Harness(num_blocks=4, num_host_blocks=8, prefix=False, preemption_mode="swap")
    a = h.add("a", 4, max_tokens=8)
    b = h.add("b", 4, max_tokens=8)
    h.step()
    swapped_out = swapped_in = False
    for _ in range(60):
        if not h.sched.has_unfinished():
            break
        out = h.step()
        if out.blocks_to_swap_out:
            swapped_out = True
            assert out.preempted_request_ids == ["b"] and b.status is SequenceStatus.SWAPPED
            assert b.num_computed_tokens > 0 and b.block_ids == []
            assert h.sched.num_swapped == 1
        if out.blocks_to_swap_in:
            swapped_in = True
            assert not out.blocks_to_swap_out  # never both in one step
    assert swapped_out and swapped_in
    assert h.tokens["a"] == h.reference(a) and h.tokens["b"] == h.reference(b)
    assert h.sched.kv_manager.host_allocator.num_free == 8


def test_swapped_sequences_come_back_before_new_admissions():
    h = Harness(num_blocks=4, num_host_blocks=8, prefix=False, preemption_mode="swap")
    h.add("a", 4, max_tokens=8)
    b = h.add("b", 4, max_tokens=8)
    h.step()
    while not h.step().blocks_to_swap_out:
        pass
    c = h.add("c", 1, max_tokens=1)
    while b.status is SequenceStatus.SWAPPED:
        h.step()
        assert c.first_scheduled_time is None or b.status is not SequenceStatus.SWAPPED
    h.run()
    assert set(h.finished) == {"a", "b", "c"}


def test_several_swapped_return_oldest_first():
    h = Harness(num_blocks=6, num_host_blocks=12, prefix=False, preemption_mode="swap")
    seqs = [h.add(rid, 4, max_tokens=14, params={"ignore_eos": True}) for rid in "abc"]
    swapped_in = []
    while h.sched.has_unfinished():
        before = {s.request_id for s in h.sched.swapped}
        h.step()
        assert h.sched.swapped == sorted(h.sched.swapped, key=lambda s: s.arrival_time)
        swapped_in += sorted(before - {s.request_id for s in h.sched.swapped})
    assert swapped_in[:2] == ["b", "c"]  # c was swapped out first, b comes back first
    for seq in seqs:
        assert h.tokens[seq.request_id] == h.reference(seq)


def test_swap_falls_back_to_recompute_without_host_blocks():
    h = Harness(num_blocks=4, num_host_blocks=1, prefix=False, preemption_mode="swap")
    h.add("a", 4, max_tokens=8)
    b = h.add("b", 4, max_tokens=8)
    h.step()
    while "b" not in h.step().preempted_request_ids:
        pass
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    h.run()
    assert h.tokens["b"] == h.reference(b)


def test_a_newer_decode_without_a_block_waits_rather_than_preempting():
    # Only the oldest running request may preempt to progress: b, newer, finds no block
    # after a took the last one, and waits (its blocks kept) instead of being recomputed.
    h = Harness(num_blocks=3, prefix=False, max_num_batched_tokens=64)
    h.add("a", 4, max_tokens=5)
    h.add("b", 4, max_tokens=2)  # prefilled with a: 2 blocks; both then need a third
    h.step()
    out = h.step()
    assert out.preempted_request_ids == []
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    h.run()
    assert set(h.finished) == {"a", "b"} and h.sched.num_preemptions == 0


def test_the_oldest_preempts_the_newest_to_progress():
    h = Harness(num_blocks=3, prefix=False, max_num_batched_tokens=64)
    h.add("a", 4, max_tokens=5)
    h.add("b", 4, max_tokens=5)
    h.add("c", 4, max_tokens=5)  # three one-block prompts fill the cache
    h.step()
    out = h.step()  # a, the oldest, needs a second block: c, the newest, goes
    assert out.preempted_request_ids == ["c"]
    assert [s.seq.request_id for s in out.scheduled][:1] == ["a"]
    h.run()
    assert set(h.finished) == {"a", "b", "c"}


# -- admission ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "field", "text"),
    [
        (0, 4, "prompt", "at least one token"),
        (40, 4, "prompt", "max_model_len 40"),
        (30, 20, "max_tokens", "prompt of 30 tokens + max_tokens 20 exceeds max_model_len 40"),
    ],
)
def test_admission_rejects_with_the_field_named(prompt_len, max_tokens, field, text):
    h = Harness(max_model_len=40)
    with pytest.raises(ValueError, match=field) as err:
        h.add("x", [7] * prompt_len, max_tokens=max_tokens)
    assert str(err.value).startswith(f"{field}:") and text in str(err.value)
    assert not h.sched.has_unfinished() and h.sched.num_waiting == 0
    assert h.step().is_empty


def test_admission_rejects_requests_that_never_fit_the_cache():
    h = Harness(num_blocks=4, max_model_len=1000)  # 16 slots
    with pytest.raises(ValueError, match=r"^max_tokens: .*never fit the KV cache"):
        h.add("x", 10, max_tokens=7)
    with pytest.raises(ValueError, match=r"^prompt: .*never fit the KV cache"):
        h.add("y", 16, max_tokens=1)
    h.add("ok", 10, max_tokens=6)  # exactly the whole cache
    assert h.sched.num_waiting == 1
    h.run()
    assert h.finished == {"ok": FinishReason.LENGTH}


def test_duplicate_request_id_rejected():
    h = Harness()
    h.add("a", 3)
    with pytest.raises(ValueError, match="^request_id:"):
        h.add("a", 3)
    assert h.sched.num_waiting == 1


# -- abort --------------------------------------------------------------------


def _assert_gone(h: Harness, seq: Sequence) -> None:
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.ABORT
    assert seq.block_ids == [] and h.sched.get(seq.request_id) is None
    h.sched.kv_manager.check_invariants(h.sched.live_sequences())


def test_abort_waiting_running_and_mid_prefill():
    h = Harness(max_num_batched_tokens=8, max_num_seqs=2)
    a = h.add("a", 20, max_tokens=4)  # will be mid-prefill
    b = h.add("b", 2, max_tokens=4)
    c = h.add("c", 2, max_tokens=4)  # waiting (max_num_seqs=2)
    h.step()
    assert a.status is SequenceStatus.RUNNING and 0 < a.num_computed_tokens < 20
    assert c.status is SequenceStatus.WAITING
    for seq in (a, c):
        assert h.sched.abort(seq.request_id)
        _assert_gone(h, seq)
    while b.num_output_tokens == 0:
        h.step()
    assert h.sched.abort("b")
    _assert_gone(h, b)
    assert h.sched.kv_manager.usage == 0 and not h.sched.has_unfinished()
    assert h.sched.abort("b") is False and h.sched.abort("nope") is False


def test_abort_swapped_returns_host_blocks():
    h = Harness(num_blocks=4, num_host_blocks=8, prefix=False, preemption_mode="swap")
    h.add("a", 4, max_tokens=8)
    b = h.add("b", 4, max_tokens=8)
    h.step()
    while b.status is not SequenceStatus.SWAPPED:
        h.step()
    h.sched.abort("b")
    _assert_gone(h, b)
    assert h.sched.kv_manager.host_allocator.num_free == 8
    h.run()


def test_abort_while_step_in_flight_is_skipped_by_update():
    h = Harness()
    a = h.add("a", 5, max_tokens=4)
    b = h.add("b", 5, max_tokens=4)
    out = h.sched.schedule()
    runner_out = h.runner.execute(out)
    h.sched.abort("a")
    outputs = h.sched.update_from_output(out, runner_out)
    assert [o.request_id for o in outputs] == ["b"]
    h.tokens["b"] = list(outputs[0].new_token_ids)
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    _assert_gone(h, a)
    h.run()
    assert h.tokens["b"] == h.reference(b)


# -- stopping -----------------------------------------------------------------


def _scripted(out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    rids = [s.seq.request_id for s in out.scheduled if s.samples]
    return ModelRunnerOutput(rids, [token] * len(rids), [None] * len(rids))


@pytest.mark.parametrize(
    ("params", "token", "reason", "stop_id"),
    [
        ({}, EOS, FinishReason.STOP, EOS),
        ({"stop_token_ids": (77,)}, 77, FinishReason.STOP, 77),
        ({"ignore_eos": True}, EOS, None, None),
        ({}, 5, None, None),
    ],
)
def test_stop_conditions(params, token, reason, stop_id):
    h = Harness()
    seq = h.add("a", 3, max_tokens=2, params=params)
    out = h.sched.schedule()
    [res] = h.sched.update_from_output(out, _scripted(out, token))
    assert res.finished is (reason is not None)
    assert res.finish_reason is reason and res.stop_token_id == stop_id
    assert res.new_token_ids == (token,) and res.num_output_tokens == 1
    if reason is None:
        out = h.sched.schedule()
        [res] = h.sched.update_from_output(out, _scripted(out, 5))
        assert res.finish_reason is FinishReason.LENGTH and res.stop_token_id is None
    assert seq.is_finished and h.sched.kv_manager.usage == 0


def test_eos_from_fake_runner_finishes_early():
    h = Harness(eos_rate=1.0)
    h.add("a", 3, max_tokens=10)
    h.run()
    assert h.tokens["a"] == [EOS] and h.finished["a"] is FinishReason.STOP


def test_eos_after_knob_and_ignore_eos():
    h = Harness()
    h.runner.eos_after = 2
    h.add("a", 3, max_tokens=10)
    h.add("b", 3, max_tokens=5, params={"ignore_eos": True})
    h.run()
    assert len(h.tokens["a"]) == 3 and h.tokens["a"][-1] == EOS
    assert h.finished == {"a": FinishReason.STOP, "b": FinishReason.LENGTH}
    assert len(h.tokens["b"]) == 5 and h.tokens["b"][2] == EOS


def test_missing_sample_in_runner_output_raises():
    h = Harness()
    h.add("a", 3)
    out = h.sched.schedule()
    with pytest.raises(ValueError, match="no token for a"):
        h.sched.update_from_output(out, ModelRunnerOutput([], [], []))


# -- priority -----------------------------------------------------------------


def test_priority_orders_waiting_and_picks_lowest_priority_victim():
    h = Harness(num_blocks=6, prefix=False, policy="priority", max_num_seqs=1)
    h.add("low", 2, max_tokens=2, priority=5)
    h.add("high", 2, max_tokens=2, priority=0)
    h.add("mid", 2, max_tokens=2, priority=1)
    order = []
    while h.sched.has_unfinished():
        for s in h.step().scheduled:
            if s.seq.request_id not in order:
                order.append(s.seq.request_id)
    assert order == ["high", "mid", "low"]


def test_priority_preempts_lowest_priority_even_if_older():
    h = Harness(num_blocks=4, prefix=False, policy="priority")
    low = h.add("low", 4, max_tokens=8, priority=9)
    high = h.add("high", 4, max_tokens=8, priority=0)
    h.step()
    preempted = []
    while h.sched.has_unfinished():
        preempted += h.step().preempted_request_ids
    assert preempted and set(preempted) == {"low"}
    assert h.tokens["high"] == h.reference(high) and h.tokens["low"] == h.reference(low)


# -- prefix caching -----------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_shared_prefix_computes_only_new_tokens(prefix):
    h = Harness(prefix=prefix)
    shared = [100 + i for i in range(40)]  # ten full blocks
    first = h.add("first", shared + [1, 2, 3], max_tokens=3)
    h.run()
    computed = h.runner.num_computed_tokens
    second = h.add("second", shared + [4, 5, 6, 7, 8], max_tokens=3)
    again = h.add("again", shared + [1, 2, 3], max_tokens=3)
    h.run()
    new_tokens = h.runner.num_computed_tokens - computed
    decode_tokens = 2 * 2  # two requests, two decode steps each
    if prefix:
        assert second.num_cached_tokens == 40 and again.num_cached_tokens == 40
        assert new_tokens == 5 + 3 + decode_tokens
        assert h.sched.kv_manager.prefix_hit_tokens == 80
    else:
        assert second.num_cached_tokens == 0
        assert new_tokens == 45 + 43 + decode_tokens
    assert h.tokens["again"] == h.tokens["first"] == h.reference(first)
    assert h.tokens["second"] == h.reference(second)


def test_partly_written_block_is_never_cached():
    h = Harness(max_num_batched_tokens=6)
    prompt = [100 + i for i in range(12)]
    a = h.add("a", prompt, max_tokens=2)
    h.step()  # 6 of 12 computed: block 0 full, block 1 half written
    assert a.num_computed_tokens == 6
    h.sched.abort("a")  # its blocks are parked or freed, block 1 must not be cached
    b = h.add("b", prompt + [1], max_tokens=2)
    h.run()
    assert b.num_cached_tokens == B
    assert h.tokens["b"] == h.reference(b)


def test_full_prompt_hit_still_samples():
    h = Harness()
    prompt = [100 + i for i in range(16)]  # exactly four blocks
    first = h.add("first", prompt, max_tokens=2)
    h.run()
    second = h.add("second", list(prompt), max_tokens=2)
    out = h.step()
    assert ids(out) == [("second", 4)]  # last block recomputed for its logits
    assert second.num_cached_tokens == 12
    h.run()
    assert h.tokens["second"] == h.tokens["first"] == h.reference(first)


def test_recompute_after_preemption_hits_own_cached_blocks():
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12)
    h.step()
    while "b" not in h.step().preempted_request_ids:
        pass
    hits_before = h.sched.kv_manager.prefix_hit_tokens
    h.run()
    assert h.sched.kv_manager.prefix_hit_tokens > hits_before
    assert b.num_cached_tokens == 0  # only the first admission counts
    assert h.tokens["b"] == h.reference(b)


# -- prefill_interval ---------------------------------------------------------


def test_prefill_interval_inserts_decode_only_steps():
    h = Harness(prefill_interval=2, max_num_batched_tokens=5)
    h.add("d", 1, max_tokens=30)
    h.step()
    h.add("long", 40, max_tokens=2)
    kinds = []
    for _ in range(8):
        out = h.step()
        kinds.append("mixed" if len(out.scheduled) == 2 else "decode")
    assert kinds[:6] == ["mixed", "mixed", "decode", "mixed", "mixed", "decode"]


def test_prefill_interval_zero_never_holds_back_prefill():
    h = Harness(prefill_interval=0, max_num_batched_tokens=5)
    h.add("d", 1, max_tokens=30)
    h.step()
    h.add("long", 40, max_tokens=2)
    assert all(len(h.step().scheduled) == 2 for _ in range(8))


def test_prefill_interval_does_not_block_prefill_without_decodes():
    h = Harness(prefill_interval=1, max_num_batched_tokens=5)
    h.add("long", 40, max_tokens=2)
    assert all(h.step().num_batched_tokens == 5 for _ in range(6))

"""Property tests: random workloads against the scheduler's invariants after every step.

Hypothesis draws a small cache (so preemption happens), both preemption
modes, prefix caching on and off, both policies, shared prompt prefixes, and
random arrivals, prompt lengths, max_tokens, EOS, aborts (queued, running,
swapped and in-flight), and samples that fork an earlier request's prompt (n > 1).
After every step: every block is free, parked or owned by live sequences, and none
that two sequences share is written; the budget and max_num_seqs hold; decodes come
first. At the end: every request finished within a bounded number of steps
(no deadlock, no starvation) with exactly the tokens it would get alone, and
the cache is back to zero usage.

Each property runs twice: with synchronous output, and with asynchronous output
(``AsyncDriver``: step N+1 is scheduled and launched before step N's ids are resolved,
in compute/engine.py's order), where the same tokens and finish reasons are expected.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from compute.core.config import CacheConfig, SchedulerConfig
from compute.core.messages import FinishReason, RequestOutput
from compute.core.outputs import SchedulerOutput
from compute.core.sampling_params import SamplingParams
from compute.core.scheduler import Scheduler
from compute.core.sequence import Sequence, SequenceStatus
from tests.core.test_fork_scheduler import assert_no_shared_block_written
from tests.support.fake_runner import FakeRunner, reference_tokens

EOS = 2
MAX_STEPS = 3000


@dataclass
class Req:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    priority: int
    ignore_eos: bool
    abort_step: int | None
    abort_in_flight: bool
    fork_of: int | None = None  # n > 1: an earlier request of the same prompt it may fork


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    sched: SchedulerConfig
    prefix: bool
    eos_rate: float
    requests: list[Req]


@st.composite
def scenarios(draw, allow_aborts: bool = True) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(3, 10))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    sched = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 20)),
        preemption_mode=mode,
        prefill_interval=draw(st.integers(0, 3)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    capacity = num_blocks * block_size
    # Sized to the cache so most requests are admissible yet together overflow it.
    prefix_len = draw(st.integers(1, max(1, min(3 * block_size, capacity // 2))))
    prefixes = [
        draw(st.lists(st.integers(3, 60), min_size=prefix_len, max_size=prefix_len)) for _ in "ab"
    ]
    third = max(1, capacity // 3)
    requests = draw(st.lists(_requests(prefixes, third, allow_aborts), min_size=1, max_size=10))
    for i, req in enumerate(requests[1:], 1):  # some are samples of an earlier request
        parent = draw(st.none() | st.integers(0, i - 1))
        if parent is not None:
            _make_fork(req, requests[parent], parent)
    return Scenario(
        block_size=block_size,
        num_blocks=num_blocks,
        num_host_blocks=draw(st.integers(0, 2 * num_blocks)) if mode == "swap" else 0,
        max_model_len=draw(st.just(capacity) | st.integers(2, capacity + 4)),
        sched=sched,
        prefix=draw(st.booleans()),
        eos_rate=draw(st.sampled_from([0.0, 0.0, 0.15, 0.4])),
        requests=requests,
    )


def _requests(prefixes: list[list[int]], max_len: int, allow_aborts: bool):
    abort_step = st.none() | st.integers(0, 30) if allow_aborts else st.none()
    return st.builds(
        Req,
        arrival_step=st.integers(0, 4),
        prompt=st.builds(
            lambda p, s: p + s,
            st.sampled_from([[], *prefixes]),
            st.lists(st.integers(3, 60), max_size=max_len),
        ),
        max_tokens=st.integers(1, max_len),
        priority=st.integers(0, 3),
        ignore_eos=st.booleans(),
        abort_step=abort_step,
        abort_in_flight=st.booleans(),
    )


def _make_fork(req: Req, parent: Req, index: int) -> None:
    req.fork_of = index
    req.prompt = list(parent.prompt)
    req.arrival_step = max(req.arrival_step, parent.arrival_step + 1)  # as samples.py does


class Driver:
    """Runs a scenario step by step, checking invariants as it goes."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.sched = Scheduler(
            sc.sched,
            CacheConfig(block_size=sc.block_size, enable_prefix_caching=sc.prefix),
            num_blocks=sc.num_blocks,
            max_model_len=sc.max_model_len,
            eos_token_ids=(EOS,),
            num_host_blocks=sc.num_host_blocks,
            clock=itertools.count().__next__,
        )
        self.runner = FakeRunner(
            sc.num_blocks, sc.block_size, sc.num_host_blocks, 64, EOS, sc.eos_rate
        )
        self.seqs: dict[str, Sequence] = {}
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, FinishReason] = {}
        self.aborted: set[str] = set()

    def run(self) -> int:
        last_arrival = max(r.arrival_step for r in self.sc.requests)
        for step in range(MAX_STEPS):
            self._arrive(step)
            self._abort(step, in_flight=False)
            if step > last_arrival and not self.sched.has_unfinished():
                return step
            self._step(step)
            if not self.sched.has_unfinished():
                self._check_idle()
        raise AssertionError(f"not finished after {MAX_STEPS} steps: deadlock or starvation")

    def _arrive(self, step: int) -> None:
        for i, req in enumerate(self.sc.requests):
            if req.arrival_step != step:
                continue
            rid = f"r{i}"
            params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
            fork_of = None if req.fork_of is None else f"r{req.fork_of}"
            seq = Sequence(
                rid, list(req.prompt), params, float(step), req.priority, fork_of=fork_of
            )
            reject = self._expected_rejection(req)
            try:
                self.sched.add_request(seq)
            except ValueError as err:
                assert reject is not None, f"{rid} rejected unexpectedly: {err}"
                assert str(err).split(":")[0] in ("prompt", "max_tokens")
                assert self.sched.get(rid) is None
                continue
            assert reject is None, f"{rid} admitted but should be rejected: {reject}"
            self.seqs[rid] = seq

    def _expected_rejection(self, req: Req) -> str | None:
        n, m, sc = len(req.prompt), req.max_tokens, self.sc
        if n == 0 or n + m > sc.max_model_len:
            return "model len"
        if -(-(n + m) // sc.block_size) > sc.num_blocks:
            return "cache"
        return None

    def _abort(self, step: int, in_flight: bool) -> None:
        for i, req in enumerate(self.sc.requests):
            rid = f"r{i}"
            due = req.abort_step == step and req.abort_in_flight == in_flight
            if due and rid in self.seqs and self.sched.abort(rid):
                self.aborted.add(rid)
                assert self.seqs[rid].block_ids == []

    def _step(self, step: int) -> None:
        out = self.sched.schedule()
        self._check_schedule(out)
        runner_out = self.runner.execute(out)
        self._abort(step, in_flight=True)
        self._record(self.sched.update_from_output(out, runner_out))
        self._check_state()

    def _record(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            assert o.request_id not in self.reasons, "output after finish"
            assert len(o.new_token_ids) == 1
            got = self.tokens.setdefault(o.request_id, [])
            got.extend(o.new_token_ids)
            assert o.num_output_tokens == len(got)
            if o.finished:
                self.reasons[o.request_id] = o.finish_reason

    def _check_schedule(self, out: SchedulerOutput) -> None:
        cfg = self.sc.sched
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        rids = [s.seq.request_id for s in out.scheduled]
        assert len(set(rids)) == len(rids)
        assert not set(rids) & set(out.preempted_request_ids)
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
        assert_no_shared_block_written(self.sched.kv_manager, out)
        seen_prefill = False
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= item.num_new_tokens <= seq.num_tokens - seq.num_computed_tokens
            is_decode = seq.num_output_tokens > 0 and item.num_new_tokens == 1 and item.samples
            assert not (is_decode and seen_prefill), "decodes must come first"
            seen_prefill = seen_prefill or not is_decode
        self._check_state()

    def _check_state(self) -> None:
        sched = self.sched
        live = sched.live_sequences()
        sched.kv_manager.check_invariants(live)
        assert sched.num_running <= self.sc.sched.max_num_seqs
        assert len(live) == sched.num_running + sched.num_waiting + sched.num_swapped
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids
            assert seq.num_computed_tokens == 0
        for seq in sched.swapped:
            assert seq.status is SequenceStatus.SWAPPED and not seq.block_ids
        for queue in (sched.waiting, sched.running, sched.swapped):
            # Preempted requests keep their place: queues stay in policy order.
            assert queue == sorted(queue, key=self._policy_key)
        assert 0.0 <= sched.kv_manager.usage <= 1.0

    def _policy_key(self, seq: Sequence) -> tuple:
        arrival = (seq.arrival_time, int(seq.request_id[1:]))
        return (seq.priority, *arrival) if self.sc.sched.policy == "priority" else arrival

    def _check_idle(self) -> None:
        kv = self.sched.kv_manager
        assert kv.usage == 0 and kv.num_free_blocks == self.sc.num_blocks
        assert kv.host_allocator.num_free == self.sc.num_host_blocks

    def check_results(self) -> None:
        self._check_idle()
        for rid, seq in self.seqs.items():
            params = seq.sampling_params
            expected = reference_tokens(seq.prompt_token_ids, params, self.runner, (EOS,))
            got = self.tokens.get(rid, [])
            if rid in self.aborted:
                assert got == expected[: len(got)] and rid not in self.reasons
                continue
            assert got == expected, f"{rid}: tokens differ from running alone"
            assert seq.status is SequenceStatus.FINISHED
            stopped = got[-1] == EOS and not seq.sampling_params.ignore_eos
            want = FinishReason.STOP if stopped else FinishReason.LENGTH
            assert self.reasons[rid] is want


class AsyncDriver(Driver):
    """Asynchronous output, in the engine's order: launch step N+1, resolve step N, then
    commit step N+1 (requests may be aborted between any two)."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__(sc)
        self.in_flight: tuple[SchedulerOutput, object] | None = None

    def _step(self, step: int) -> None:
        out = self.sched.schedule()
        self._check_schedule(out)
        for item in out.scheduled:  # a pending input is only ever a decode's one token
            seq = item.seq
            if seq.num_pending:
                assert item.num_new_tokens == 1 and seq.num_pending == 1
                assert seq.num_computed_tokens + 1 == seq.num_tokens
        launched = self.runner.launch(out)
        self._abort(step, in_flight=True)
        previous, self.in_flight = self.in_flight, (out, launched)
        if previous is not None:
            self._record(self.sched.resolve(previous[0], previous[1].resolve()))
        self.sched.commit(out)
        if not self.sched.has_unfinished():
            self.in_flight = None  # the engine drains it: nobody's outputs
        for seq in self.sched.live_sequences():
            assert seq.num_pending <= 1 or seq.status is SequenceStatus.RUNNING
            assert seq.num_pending <= 2
        self._check_state()


DRIVERS = pytest.mark.parametrize("driver_cls", [Driver, AsyncDriver], ids=["sync", "async"])


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@DRIVERS
@SETTINGS
@given(sc=scenarios())
def test_random_workloads_keep_invariants_and_finish(driver_cls, sc: Scenario):
    driver = driver_cls(sc)
    driver.run()
    driver.check_results()
    target(float(driver.sched.num_preemptions), label="preemptions")


@DRIVERS
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False])
def test_heavy_load_exercises_preemption_and_still_matches(mode, prefix, driver_cls):
    """A fixed overload (12 requests, 8 blocks) so the random runs are known to preempt."""
    rng = random.Random(f"{mode}-{prefix}")
    shared = [rng.randrange(3, 60) for _ in range(6)]
    requests = [
        Req(
            arrival_step=rng.randrange(4),
            prompt=shared[: rng.randrange(7)] + [rng.randrange(3, 60) for _ in range(5)],
            max_tokens=rng.randrange(4, 12),
            priority=rng.randrange(3),
            ignore_eos=True,
            abort_step=None,
            abort_in_flight=False,
        )
        for _ in range(12)
    ]
    sc = Scenario(
        block_size=2,
        num_blocks=12,
        num_host_blocks=6 if mode == "swap" else 0,
        max_model_len=64,
        sched=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, preemption_mode=mode),
        prefix=prefix,
        eos_rate=0.0,
        requests=requests,
    )
    driver = driver_cls(sc)
    driver.run()
    driver.check_results()
    assert driver.sched.num_preemptions > 0


@DRIVERS
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False])
def test_heavy_load_of_forked_samples_still_matches(mode, prefix, driver_cls):
    """Three prompts of four samples each, arriving a step after their first, in a cache
    too small for them all: forks, fallbacks and preemptions of both sides."""
    rng = random.Random(f"fork-{mode}-{prefix}")
    requests = []
    for k in range(3):
        first = Req(k, [rng.randrange(3, 60) for _ in range(7)], 10, 0, True, None, False)
        requests.append(first)
        for _ in range(3):
            sample = Req(k + 1, [], rng.randrange(4, 12), 0, True, None, False)
            _make_fork(sample, first, requests.index(first))
            requests.append(sample)
    sc = Scenario(
        block_size=2,
        num_blocks=16,
        num_host_blocks=8 if mode == "swap" else 0,
        max_model_len=64,
        sched=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, preemption_mode=mode),
        prefix=prefix,
        eos_rate=0.0,
        requests=requests,
    )
    driver = driver_cls(sc)
    driver.run()
    driver.check_results()
    assert driver.sched.num_preemptions > 0
    assert driver.sched.num_forked > 0
    if driver_cls is AsyncDriver:
        assert driver.runner.num_placeholders_fed > 0
    assert len(driver.reasons) == 12
    if prefix:
        assert driver.sched.kv_manager.prefix_hit_tokens > 0

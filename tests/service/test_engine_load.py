"""LoadTracker: what a load record says between and after the step loop's reports
(generation rate, engine silence, whether the load a router reads changed), on a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

from services.pipeline.engine_load import EngineShape, LoadTracker
from tests.conftest import fake_engine

SHAPE = EngineShape(max_running=8, token_capacity=1024)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def stats(**fields):
    return dataclasses.replace(fake_engine().stats(), **fields)


def tracker(clock: Clock, pending: list[int], since: list[float | None]) -> LoadTracker:
    return LoadTracker(SHAPE, stats(), lambda: pending[0], lambda: since[0], clock)


def test_silence_counts_from_the_last_report_while_requests_are_in_flight(clock) -> None:
    pending, since = [0], [None]
    load = tracker(clock, pending, since)
    assert load.sample().engine_silence_ms is None  # nothing in flight: no silence
    pending[0], since[0] = 1, clock.now  # a request arrives after a quiet spell
    clock.now += 0.25
    assert load.sample().engine_silence_ms == 250  # not the whole quiet spell
    load.update(stats(num_running=1), clock.now, busy=True)
    clock.now += 4.0  # the engine reports nothing more: wedged
    sample = load.sample()
    assert sample.engine_silence_ms == 4000 and sample.age_ms == 4000


def test_generation_rate_over_the_recent_window(clock) -> None:
    load = tracker(clock, [1], [clock.now])
    for tokens in range(0, 101, 10):  # 10 tokens per 0.1 s
        load.update(stats(generation_tokens=tokens), clock.now, busy=True)
        clock.now += 0.1
    assert load.sample().gen_throughput == pytest.approx(100 / 1.1, rel=0.01)
    clock.now += 10.0  # nothing since: the window is empty
    assert load.sample().gen_throughput == 0.0


def test_the_version_moves_only_when_the_routing_view_changes(clock) -> None:
    load = tracker(clock, [0], [None])
    assert load.update(stats(num_running=1), clock.now, busy=True)
    version = load.version
    assert not load.update(stats(num_running=1), clock.now, busy=True)
    assert load.version == version
    assert load.update(stats(num_running=1, kv_slots_used=17), clock.now, busy=True)


def test_cache_hit_rate_is_hits_over_all_prompt_tokens(clock) -> None:
    load = tracker(clock, [0], [None])
    assert load.sample().cache_hit_rate is None  # no prompt yet
    load.update(stats(prefix_cache_hit_tokens=30, prompt_tokens=70), clock.now, busy=False)
    assert load.sample().cache_hit_rate == pytest.approx(0.3)

"""The engine's load as a gateway routes by it: stage 2's latest stats and what follows.

The KV-event hub (services/pipeline/kv_event_hub.py) feeds ``LoadTracker.update`` with the
stats of every step-loop turn; ``sample`` turns them into a ``LoadSample`` when a record is
sent: the stats themselves, the generation rate over the last seconds, and how long the
engine has been silent while requests were in flight (``engine_silence_ms``: the step loop
reports every turn, so a silence longer than a step means the engine is wedged or busy
with one long step, which ``prefill_pending_tokens`` lets a gateway tell apart).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from compute.core.messages import EngineStats

THROUGHPUT_WINDOW_S = 5.0  # generation rate: tokens over the last this many seconds
_RATE_SAMPLE_S = 0.1  # one (time, tokens) sample per this long: the window stays small


@dataclass(frozen=True)
class EngineShape:
    """What does not change while serving: limits and memory, for load records."""

    max_running: int  # --max-num-seqs: the engine's admission window
    token_capacity: int  # KV blocks x block size
    weight_bytes: int | None = None  # model weights in memory, when measured
    kv_cache_bytes: int | None = None  # the KV cache's tensors, when measured


@dataclass(frozen=True)
class LoadSample:
    """One load record's numbers, as of ``sample()``."""

    stats: EngineStats
    shape: EngineShape
    gen_throughput: float  # tokens per second over the last THROUGHPUT_WINDOW_S
    engine_silence_ms: int | None  # None: no request in flight (silence means nothing)
    age_ms: int  # how old the stats are (0 when the engine is idle: they are current)

    @property
    def cache_hit_rate(self) -> float | None:
        """Prompt tokens served by the prefix cache over all prompt tokens, since start."""
        hits, computed = self.stats.prefix_cache_hit_tokens, self.stats.prompt_tokens
        return hits / (hits + computed) if hits + computed else None


class LoadTracker:
    """The latest stats stage 2 reported, and when; owned by the server's event loop."""

    def __init__(
        self,
        shape: EngineShape,
        stats: EngineStats,
        pending: Callable[[], int],
        active_since: Callable[[], float | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shape = shape
        self._pending = pending  # requests admitted and not finished (the pipeline's count)
        self._active_since = active_since  # when that count last left zero
        self._clock = clock
        self._stats = stats
        self._turn_time = clock()  # when stage 2 last reported
        self._busy = False
        self._generated: deque[tuple[float, int]] = deque()  # (time, cumulative tokens)
        self.version = 0  # bumped when what a router reads changed

    def update(self, stats: EngineStats, turn_time: float, busy: bool) -> bool:
        """Take one turn's report; True when the load a router reads changed."""
        before = _routing_view(self._stats), self._busy
        self._stats, self._turn_time, self._busy = stats, turn_time, busy
        sample = (turn_time, stats.generation_tokens)
        samples = self._generated
        if len(samples) >= 2 and turn_time - samples[-2][0] < _RATE_SAMPLE_S:
            samples[-1] = sample  # the newest sample moves on: one per period is kept
        else:
            samples.append(sample)
        while self._generated and self._generated[0][0] < turn_time - THROUGHPUT_WINDOW_S:
            self._generated.popleft()
        changed = (_routing_view(stats), busy) != before
        if changed:
            self.version += 1
        return changed

    def sample(self) -> LoadSample:
        now = self._clock()
        return LoadSample(
            stats=self._stats,
            shape=self.shape,
            gen_throughput=self._throughput(now),
            engine_silence_ms=self._silence_ms(now),
            age_ms=int(1000 * (now - self._turn_time)) if self._busy else 0,
        )

    def _throughput(self, now: float) -> float:
        recent = [(t, n) for t, n in self._generated if t >= now - THROUGHPUT_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        (start, first), (_, last) = recent[0], recent[-1]
        return (last - first) / max(now - start, 1e-3)

    def _silence_ms(self, now: float) -> int | None:
        """Since the engine last reported, or since requests arrived after a quiet spell;
        None while nothing is in flight."""
        if self._pending() <= 0:
            return None
        since = max(self._turn_time, self._active_since() or self._turn_time)
        return max(0, int(1000 * (now - since)))


def _routing_view(stats: EngineStats) -> tuple:
    return (stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.kv_slots_used)

"""The KV-event hub: stage 2's prefix-cache events, numbered, kept and fanned out.

The step loop hands every turn's ``CacheUpdate`` (the blocks the prefix cache stored and
evicted in it, and the engine's stats) to ``publish``, from its own thread: that only
appends to a deque and, once per burst, wakes the server's event loop. There the hub
numbers each turn that carried events as one batch, keeps the last ``history`` batches
(a subscriber resumes after the sequence number it saw last), mirrors the cached blocks
(what a subscriber starting afresh gets first, as a snapshot), updates the load tracker,
and puts each batch in every subscriber's bounded queue (services/pipeline/kv_subscription.py).
A subscriber whose queue is full is dropped -- its stream ends DATA_LOSS and it resyncs
from a snapshot -- so a slow or vanished subscriber costs the step loop nothing and the
server a bounded amount of memory.

Sequence numbers start above the wall clock in microseconds at start-up, so a cursor from an
earlier run of the server (a gateway reconnecting after a restart) is never taken for
one of this run: it is refused (OUT_OF_RANGE) and the gateway resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from compute.core.kv_events import BlockRemoved, BlockStored, CacheCleared, KvEvent
from compute.core.messages import CacheFlushed, CacheUpdate, EngineStats
from kernels.log import get_logger
from services.domain import RequestError, ResourceExhausted
from services.pipeline.engine_load import EngineShape, LoadTracker
from services.telemetry.metrics import NO_METRICS, Metrics

HISTORY_BATCHES = 4096  # batches kept for resuming subscribers
QUEUE_BATCHES = 256  # batches a subscriber may lag behind before it is dropped
PENDING_LIMIT = 65536  # turns held while no event loop drains them (then events are lost)
MAX_SUBSCRIBERS = 32

log = get_logger(__name__)


class CursorExpired(RequestError):
    """The resume point is not in this run's history: resubscribe from 0 (a snapshot)."""

    code = "OUT_OF_RANGE"


@dataclass(frozen=True)
class EventBatch:
    """Events of one step-loop turn (or a snapshot), as subscribers receive them."""

    sequence_number: int
    timestamp: float  # wall-clock seconds when the turn ended
    events: tuple[KvEvent, ...]
    snapshot: bool = False  # the cache's whole state (CacheCleared, then every block)


class KvEventHub:
    """Numbering, history, mirror and fan-out of the prefix cache's events."""

    def __init__(
        self,
        shape: EngineShape,
        stats: EngineStats,
        pending: Callable[[], int],
        active_since: Callable[[], float | None],
        metrics: Metrics = NO_METRICS,
        history: int = HISTORY_BATCHES,
    ) -> None:
        self.load = LoadTracker(shape, stats, pending, active_since)
        self._metrics = metrics
        self._inbox: deque[CacheUpdate | CacheFlushed] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False  # a drain is scheduled on the loop
        self._lost = False  # turns were dropped before a loop drained them
        self.head = self.first = time.time_ns() // 1000  # the last batch number given out
        self._history: deque[EventBatch] = deque(maxlen=history)
        self._cached: OrderedDict[int, BlockStored] = OrderedDict()  # block hash -> its store
        self._subscribers: set = set()  # kv_subscription.SubscriberQueue
        self._flushes: dict[int, asyncio.Future[CacheFlushed]] = {}
        self._flush_ids = itertools.count(1)
        self.queue_size = QUEUE_BATCHES  # each subscriber's queue (kv_subscription.py)

    # -- stage 2's side (any thread) ------------------------------------------------------

    def publish(self, record: CacheUpdate | CacheFlushed) -> None:
        """Queue a record from stage 2; never blocks (one loop wake-up per burst)."""
        if len(self._inbox) >= PENDING_LIMIT:  # nobody drains: keep memory bounded
            with contextlib.suppress(IndexError):
                self._inbox.popleft()
            self._lost = True
        self._inbox.append(record)
        loop = self._loop
        if loop is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed (tests that stop one server and start another)
            self._loop = None
            self._wake_pending = False

    # -- the event loop's side --------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drain on ``loop`` from now on (the server's; idempotent)."""
        if self._loop is loop and not loop.is_closed():
            return
        self._loop = loop
        self._wake_pending = True
        loop.call_soon_threadsafe(self._drain)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def add(self, subscriber) -> None:
        """Register ``subscriber`` (kv_subscription.SubscriberQueue) for every later batch."""
        self.attach(asyncio.get_running_loop())
        self._drain()  # what stage 2 has sent so far is in the history and mirror first
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise ResourceExhausted(f"too many KV-event subscribers (max {MAX_SUBSCRIBERS})")
        self._subscribers.add(subscriber)
        self._metrics.observe_kv_subscribers(len(self._subscribers))

    def remove(self, subscriber) -> None:
        self._subscribers.discard(subscriber)
        self._metrics.observe_kv_subscribers(len(self._subscribers))

    def replay(self, start: int) -> list[EventBatch]:
        """What a subscriber resuming after batch ``start`` missed; a snapshot for 0.
        CursorExpired when this run's history does not reach back to ``start``."""
        if start == 0:
            return [self._snapshot()] if self.head > self.first else []
        oldest = self._history[0].sequence_number if self._history else self.head + 1
        if not oldest - 1 <= start <= self.head:
            self._metrics.observe_kv_resync("cursor_expired")
            raise CursorExpired(
                f"start_sequence_number: {start} is not in this server's event history "
                f"(it holds {oldest}..{self.head}); subscribe from 0 for the current state"
            )
        return [b for b in self._history if b.sequence_number > start]

    async def flush(self, submit: Callable[[int], None], timeout: float) -> CacheFlushed:
        """Ask stage 2 to drop the prefix cache (``submit(flush_id)``) and wait for its
        answer; TimeoutError when it does not come within ``timeout`` seconds."""
        self.attach(asyncio.get_running_loop())
        flush_id = next(self._flush_ids)
        answer = self._flushes[flush_id] = asyncio.get_running_loop().create_future()
        try:
            submit(flush_id)
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._flushes.pop(flush_id, None)

    def _snapshot(self) -> EventBatch:
        self._metrics.observe_kv_resync("snapshot")
        events = (CacheCleared(), *self._cached.values())
        return EventBatch(self.head, time.time(), events, snapshot=True)

    def _drain(self) -> None:
        self._wake_pending = False
        if self._lost:
            self._lost = False
            log.warning("KV events were lost before the event loop took them; subscribers clear")
            self._cached.clear()
            self._emit((CacheCleared(),), time.monotonic())
        while self._inbox:
            record = self._inbox.popleft()
            if isinstance(record, CacheFlushed):
                answer = self._flushes.get(record.flush_id)
                if answer is not None and not answer.done():
                    answer.set_result(record)
                continue
            if record.events:
                self._emit(record.events, record.time)
            if self.load.update(record.stats, record.time, record.busy):
                for subscriber in self._subscribers:
                    subscriber.wake()

    def _emit(self, events: tuple[KvEvent, ...], turn_time: float) -> None:
        self.head += 1
        wall = time.time() - (time.monotonic() - turn_time)
        batch = EventBatch(self.head, wall, events)
        self._history.append(batch)
        self._mirror(events)
        stored = sum(isinstance(e, BlockStored) for e in events)
        removed = sum(isinstance(e, BlockRemoved) for e in events)
        self._metrics.observe_kv_published(stored, removed)
        for subscriber in list(self._subscribers):
            if not subscriber.offer(batch):
                self.remove(subscriber)
                self._metrics.observe_kv_subscriber_dropped("queue_full")
                log.warning("KV-event subscriber fell behind; dropped (it resyncs)")

    def _mirror(self, events: tuple[KvEvent, ...]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._cached[event.block_hash] = event
            elif isinstance(event, BlockRemoved):
                self._cached.pop(event.block_hash, None)
            else:
                self._cached.clear()

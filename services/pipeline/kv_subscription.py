"""One KV-event subscriber: its bounded queue, and the cadence of what it is sent.

``subscribe`` yields ``Outgoing`` records: first what the subscriber missed (the batches
after its resume point, or a snapshot of the cache when it starts from 0), then every new
batch, and between batches load-only records numbered with the last batch sent: when the
load changed without an event (coalesced, at most one per LOAD_MIN_GAP_S) and as a
heartbeat every HEARTBEAT_S, so that a gateway sees an idle engine alive and a wedged one
silent. Before its first batch a subscriber gets load-only records only if it asked
(``load_records_before_first_batch``), numbered 0.

The hub fills the queue; when it is full the subscriber is dropped and its stream ends
DATA_LOSS (resubscribe from 0: a snapshot), never waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.domain import RequestError
from services.pipeline.kv_event_hub import EventBatch, KvEventHub
from services.telemetry.metrics import NO_METRICS, Metrics

LOAD_MIN_GAP_S = 0.02  # load-only records on changes: at most one per this many seconds
HEARTBEAT_S = 0.5  # a load-only record when nothing was sent for this long


class FellBehind(RequestError):
    """The subscriber's queue overflowed: resubscribe from 0 for the current state."""

    code = "DATA_LOSS"


@dataclass(frozen=True)
class Outgoing:
    """One record for the stream: a batch of events, or the load alone (``batch`` None)."""

    sequence_number: int
    batch: EventBatch | None
    first: bool  # the stream's first record (it carries the whole telemetry)


class Subscription:
    """The hub's handle on one subscriber: ``offer`` never blocks."""

    def __init__(self, size: int) -> None:
        self._queue: deque[EventBatch] = deque()
        self._size = size
        self._wake = asyncio.Event()
        self.dropped = False

    def offer(self, batch: EventBatch) -> bool:
        """Queue ``batch``; False (and dropped) when the queue is full."""
        if len(self._queue) >= self._size:
            self.dropped = True
        else:
            self._queue.append(batch)
        self._wake.set()
        return not self.dropped

    def wake(self) -> None:
        """The load changed: the sender may owe a load-only record."""
        self._wake.set()

    def take(self) -> EventBatch | None:
        self._wake.clear()
        return self._queue.popleft() if self._queue else None

    async def wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(seconds, 0.0))


async def subscribe(
    hub: KvEventHub, start: int, early_loads: bool, metrics: Metrics = NO_METRICS
) -> AsyncIterator[Outgoing]:
    """The records of one subscription resuming after batch ``start`` (0: from now, with a
    snapshot); CursorExpired / ResourceExhausted before the first, FellBehind later."""
    subscription = Subscription(hub.queue_size)
    hub.add(subscription)  # first: every batch after the replay reaches its queue
    try:
        sender = _Sender(hub, subscription, start, early_loads, metrics)
        for batch in hub.replay(start):
            yield sender.batch(batch)
        while True:
            record = sender.next_record()
            if record is None:
                await subscription.wait(sender.wait_seconds())
            else:
                yield record
    finally:
        hub.remove(subscription)


class _Sender:
    """What is due on one stream, and when."""

    def __init__(
        self,
        hub: KvEventHub,
        subscription: Subscription,
        start: int,
        early_loads: bool,
        metrics: Metrics,
    ) -> None:
        self._hub, self._subscription, self._metrics = hub, subscription, metrics
        self._early_loads = early_loads
        self._sent = start  # the last batch number this subscriber has
        self._first = True
        self._last_time = float("-inf")
        self._version = -1

    def batch(self, batch: EventBatch) -> Outgoing:
        kind = "snapshot" if batch.snapshot else "events"
        self._metrics.observe_kv_batch_sent(kind, len(batch.events))
        self._sent = batch.sequence_number
        return self._record(batch)

    def next_record(self) -> Outgoing | None:
        """The next record due now (a queued batch first), or None: wait."""
        if self._subscription.dropped:
            raise FellBehind(
                "this KV-event subscriber fell behind and was dropped; subscribe from 0 for "
                "the current state"
            )
        batch = self._subscription.take()
        if batch is not None:
            return self.batch(batch)
        if self.wait_seconds() > 0:
            return None
        if not (self._sent or self._early_loads):  # no load record before the first batch
            self._last_time, self._version = time.monotonic(), self._hub.load.version
            return None
        self._metrics.observe_kv_batch_sent("load_only", 0)
        return self._record(None)

    def wait_seconds(self) -> float:
        changed = self._hub.load.version != self._version
        gap = LOAD_MIN_GAP_S if changed else HEARTBEAT_S
        return gap - (time.monotonic() - self._last_time)

    def _record(self, batch: EventBatch | None) -> Outgoing:
        record = Outgoing(self._sent, batch, self._first)
        self._first = False
        self._last_time = time.monotonic()
        self._version = self._hub.load.version
        return record

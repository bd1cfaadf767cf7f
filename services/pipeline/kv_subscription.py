"""One KV-event subscriber: its bounded queue, and the cadence of what it is sent.

A ``KvSubscription`` is opened at once -- so that a resume point outside the history is
refused before the stream's headers go out, as a gateway expects (OUT_OF_RANGE: resync)
-- and its ``records`` are ``Outgoing``: first what the subscriber missed (the batches
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


class SubscriberQueue:
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


class KvSubscription:
    """One subscription resuming after batch ``start`` (0: from now, with a snapshot).

    Opening it raises CursorExpired or ResourceExhausted; ``records`` raises FellBehind
    once the hub dropped it; ``close`` (always call it) unsubscribes."""

    def __init__(
        self, hub: KvEventHub, start: int, early_loads: bool, metrics: Metrics = NO_METRICS
    ) -> None:
        self._hub = hub
        self._queue = SubscriberQueue(hub.queue_size)
        hub.add(self._queue)  # first: every batch after the replay reaches its queue
        try:
            self._missed = hub.replay(start)
        except BaseException:
            hub.remove(self._queue)
            raise
        self._sender = _Sender(hub, self._queue, start, early_loads, metrics)

    async def records(self) -> AsyncIterator[Outgoing]:
        for batch in self._missed:
            yield self._sender.batch(batch)
        self._missed = []
        while True:
            record = self._sender.next_record()
            if record is None:
                await self._queue.wait(self._sender.wait_seconds())
            else:
                yield record

    def close(self) -> None:
        self._hub.remove(self._queue)


class _Sender:
    """What is due on one stream, and when."""

    def __init__(
        self,
        hub: KvEventHub,
        subscription: SubscriberQueue,
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

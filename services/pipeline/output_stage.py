"""Stage 3: the output pool, from token deltas to each request's event stream.

Per request it detokenizes incrementally, matches stop strings (holding back text
that may be the start of one), decides the finish, and delivers ``Chunk``/``Complete``
(or a ``RequestError``) to the request's asyncio queue on the server's event loop. A
stop-string hit finishes the stream at once and sends an ``Abort`` back to stage 2 so
the engine frees the sequence. The per-request work is ``RequestState``
(services/pipeline/request_state.py); this module owns the workers and the delivery.

Requests are sharded over the workers by id, so one request's events stay in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from compute.core.errors import FieldError
from compute.core.messages import (
    AddRequest,
    FailureKind,
    RequestFailed,
    RequestOutput,
    Shutdown,
    StepOutputs,
)
from compute.tokenizer.tokenizer import Tokenizer
from kernels.log import get_logger
from services.domain import Chunk, Complete, EngineFault, RequestError, Unavailable
from services.pipeline.request_state import Event, Outcome, RequestState, RequestStream
from services.telemetry.metrics import NO_METRICS, Metrics

log = get_logger(__name__)

Inbound = StepOutputs | RequestFailed | Shutdown


class Deliveries:
    """Events of one batch, grouped per event loop: one thread-safe wake-up per loop."""

    def __init__(self) -> None:
        self._by_loop: defaultdict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Event]]]
        self._by_loop = defaultdict(list)

    def add(self, stream: RequestStream, events: list[Event]) -> None:
        self._by_loop[stream.loop].extend((stream, event) for event in events)

    def send(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the server's loop is closed: nobody is listening
                log.warning("event loop closed; dropping events", num_events=len(items))
        self._by_loop.clear()


def _put_all(items: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in items:
        stream.put(event)


_OUTPUT_FAULT = "the server failed while streaming this request"


class OutputStage:
    """Stage 3 workers plus the registry of live request streams."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        send_abort: Callable[[str], None],
        metrics: Metrics = NO_METRICS,
        num_workers: int = 1,
    ) -> None:
        self._tokenizer = tokenizer
        self._send_abort = send_abort
        self._metrics = metrics
        self._inboxes: list[queue.Queue[Inbound]] = [queue.Queue() for _ in range(num_workers)]
        self._lock = threading.Lock()
        self._requests: dict[str, RequestState] = {}
        self._closed = False
        self.crashed = False  # a worker died: its requests would never end (the server stops)

    # -- called from the facade (asyncio thread) and stage 2 ---------------------------

    def register(self, req: AddRequest, stream: RequestStream) -> None:
        """Must happen before the request reaches stage 2, so no output finds it missing."""
        with self._lock:
            if self._closed:
                raise Unavailable("the server is shutting down")
            self._requests[req.request_id] = RequestState(req, stream, self._tokenizer)

    def release(self, request_id: str) -> bool:
        """Forget a request (later outputs for it are dropped); False if already gone."""
        with self._lock:
            return self._requests.pop(request_id, None) is not None

    def submit(self, msg: StepOutputs | RequestFailed) -> None:
        """Stage 2's send: never blocks (unbounded queues; bounded upstream by admission)."""
        n = len(self._inboxes)
        if n == 1:
            self._inboxes[0].put(msg)
        elif isinstance(msg, RequestFailed):
            self._inboxes[self._shard(msg.request_id)].put(msg)
        else:
            for shard, part in _split(msg, n, self._shard).items():
                self._inboxes[shard].put(part)

    def _shard(self, request_id: str) -> int:
        return hash(request_id) % len(self._inboxes)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.run, args=(i,), name=f"headrace-output-{i}", daemon=True)
            for i in range(len(self._inboxes))
        ]
        for thread in threads:
            thread.start()
        return threads

    def request_stop(self) -> None:
        for inbox in self._inboxes:
            inbox.put(Shutdown())

    def fail_remaining(self, message: str) -> None:
        """After the workers stopped: end every stream still open with Unavailable."""
        with self._lock:
            self._closed = True
            states, self._requests = list(self._requests.values()), {}
        deliveries = Deliveries()
        for state in states:
            deliveries.add(state.stream, [Unavailable(message)])
        deliveries.send()

    # -- the worker -----------------------------------------------------------------------

    def run(self, shard: int) -> None:
        """Thread entry of one output worker."""
        try:
            self.event_loop(shard)
        except BaseException:
            self.crashed = True
            log.exception("output worker died", shard=shard)
            self._fail_shard(shard)  # its requests would wait for events that never come
            raise

    def _fail_shard(self, shard: int) -> None:
        with self._lock:
            states = [s for rid, s in self._requests.items() if self._shard(rid) == shard]
        deliveries = Deliveries()
        for state in states:
            self._fail(state, deliveries)
        deliveries.send()

    def event_loop(self, shard: int) -> None:
        inbox = self._inboxes[shard]
        while True:
            batch = _drain(inbox)
            deliveries = Deliveries()
            for msg in batch:
                if isinstance(msg, Shutdown):
                    deliveries.send()
                    return
                if isinstance(msg, StepOutputs):
                    self._on_step(msg, deliveries)
                else:
                    self._on_failed(msg, deliveries)
            deliveries.send()

    def _on_step(self, step: StepOutputs, deliveries: Deliveries) -> None:
        if step.stats is not None:
            self._metrics.observe_engine_stats(step.stats)
        if step.timing is not None:
            self._metrics.observe_step(step.timing)
        now = time.monotonic()
        for output in step.outputs:
            state = self._lookup(output.request_id)
            if state is None:
                continue  # cancelled or already ended by a stop string
            try:
                outcome = state.on_output(output, step.step_start, now)
            except Exception:  # a bug met by this request's output: it alone ends
                log.exception("output stage failed on a request", request_id=state.request_id)
                self._fail(state, deliveries)
                continue
            self._observe(state, outcome, now)
            deliveries.add(state.stream, outcome.events)
            if outcome.done:
                self.release(state.request_id)
            if outcome.abort_engine:
                self._send_abort(state.request_id)

    def _fail(self, state: RequestState, deliveries: Deliveries) -> None:
        """End one request with INTERNAL and free it in the engine; the others go on."""
        if self.release(state.request_id):
            deliveries.add(state.stream, [EngineFault(_OUTPUT_FAULT)])
            self._send_abort(state.request_id)
            self._metrics.observe_finished("error")

    def _on_failed(self, msg: RequestFailed, deliveries: Deliveries) -> None:
        state = self._lookup(msg.request_id)
        if state is None:
            return
        self.release(msg.request_id)
        deliveries.add(state.stream, [_error(msg)])
        if msg.kind is FailureKind.INVALID_ARGUMENT:
            self._metrics.observe_rejected("invalid_argument")
        else:
            self._metrics.observe_finished(
                "error" if msg.kind is FailureKind.ENGINE_FAULT else "abort"
            )

    def _lookup(self, request_id: str) -> RequestState | None:
        with self._lock:
            return self._requests.get(request_id)

    def _observe(self, state: RequestState, outcome: Outcome, now: float) -> None:
        """Latency metrics: TTFT/queue at the first token chunk, ITL after, e2e at the end."""
        chunk = next((e for e in outcome.events if isinstance(e, Chunk) and e.token_ids), None)
        if chunk is not None:
            if state.first_token is None:
                state.first_token = now
                queue_s = (state.first_scheduled or now) - state.arrival
                self._metrics.observe_first_token(queue_s, now - state.arrival)
            elif state.last_token is not None:
                self._metrics.observe_inter_token(now - state.last_token, len(chunk.token_ids))
            state.last_token = now
        if outcome.done:
            final = outcome.events[-1]
            reason = final.finish_reason if isinstance(final, Complete) else "error"
            self._metrics.observe_finished(reason, now - state.arrival)
            if state.first_token is not None:
                self._metrics.observe_decode(now - state.first_token)


def _drain(inbox: queue.Queue[Inbound], limit: int = 64) -> list[Inbound]:
    """Block for one message, then take what else is queued: one delivery per batch."""
    batch = [inbox.get()]
    while len(batch) < limit:
        try:
            batch.append(inbox.get_nowait())
        except queue.Empty:
            break
    return batch


def _split(step: StepOutputs, n: int, shard_of: Callable[[str], int]) -> dict[int, StepOutputs]:
    """One StepOutputs per shard with outputs (shard 0 always, as it mirrors the stats)."""
    parts: dict[int, list[RequestOutput]] = {0: []}
    for output in step.outputs:
        parts.setdefault(shard_of(output.request_id), []).append(output)
    return {
        shard: StepOutputs(
            tuple(outputs),
            step.step_start,
            step.step_end,
            step.stats if shard == 0 else None,
            step.timing if shard == 0 else None,
        )
        for shard, outputs in parts.items()
    }


def _error(msg: RequestFailed) -> RequestError:
    if msg.kind is FailureKind.INVALID_ARGUMENT:
        return FieldError(msg.field or "request", msg.message)
    if msg.kind is FailureKind.UNAVAILABLE:
        return Unavailable(msg.message)
    return EngineFault(msg.message)

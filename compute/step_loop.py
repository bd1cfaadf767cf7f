"""Stage 2: the step loop, one thread that owns the engine.

It receives ``AddRequest``/``Abort`` records on its inbox, runs ``engine.step()`` for as
long as requests are in flight, and hands each step's ``RequestOutput`` records (as the
scheduler made them) to stage 3 in one ``StepOutputs`` record, without waiting for them to
be consumed. It never tokenizes, detokenizes or touches gRPC, so the accelerator is fed
back to back.

With a ``publish`` hand-off (the KV-event hub's, services/pipeline/kv_event_hub.py), it also
passes on, after every turn, the blocks the prefix cache stored and evicted in it with the
engine's stats (``CacheUpdate``), and answers ``FlushPrefixCache`` there (``CacheFlushed``);
the hand-off only queues, so subscribers never slow the loop.

A request the engine traced a step failure to (``Engine.take_failed``) gets a
``RequestFailed`` alone. An exception out of ``engine.step()`` itself fails the requests
in the engine at the time; the loop then goes on serving new requests, unless that was
the MAX_FAILED_STEPS-th such step in a row: then the engine is deemed broken and the loop
stops (``crashed``), as it does on any exception of its own.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from compute.core.errors import FieldError
from compute.core.kv_events import KvEvent
from compute.core.messages import (
    Abort,
    AddRequest,
    CacheFlushed,
    CacheUpdate,
    EngineStats,
    FailureKind,
    FlushPrefixCache,
    RequestFailed,
    RequestOutput,
    Shutdown,
    StepOutputs,
    StepTiming,
)
from compute.core.sampling_params import SamplingParams
from compute.runner.fault_isolation import FAULT_MESSAGE
from kernels.log import get_logger

log = get_logger(__name__)
# A step whose failure the engine could not pin on one request fails the whole batch; this
# many in a row means the engine itself is broken (a sticky CUDA error, corrupt state), and
# a server that kept accepting requests only to fail them would look healthy to its
# balancer. The loop stops instead, and the server reports NOT_SERVING and exits.
MAX_FAILED_STEPS = 3


class EngineBroken(RuntimeError):
    """The engine failed MAX_FAILED_STEPS steps in a row."""


Inbound = AddRequest | Abort | FlushPrefixCache | Shutdown
Outbound = StepOutputs | RequestFailed
Published = CacheUpdate | CacheFlushed  # to the KV-event hub


class SteppedEngine(Protocol):
    """What the step loop needs of an engine (compute/engine.py; tests bring fakes)."""

    last_step_timing: StepTiming | None  # of the latest step()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        fork_of: str | None = None,
        cache_salt: str | None = None,
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def record_kv_events(self, on: bool = True) -> None: ...

    def take_kv_events(self) -> tuple[KvEvent, ...]: ...

    def flush_prefix_cache(self) -> tuple[int, int]: ...

    def step(self) -> list[RequestOutput]: ...

    def take_failed(self) -> list[tuple[str, str]]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...


class StepLoop:
    """Drives ``engine.step()``; the only code that touches the engine once started."""

    def __init__(
        self,
        engine: SteppedEngine,
        inbox: queue.Queue[Inbound],
        send: Callable[[Outbound], None],
        active_since: Callable[[], float | None],
        publish: Callable[[Published], None] | None = None,
    ) -> None:
        self._engine = engine
        self._inbox = inbox
        self._send = send
        self._publish = publish
        if publish is not None:
            engine.record_kv_events()
        # When the pipeline last went from no requests to some (None: none now); a wait
        # for input overlapping that is time the step loop starved.
        self._active_since = active_since
        self._in_flight: set[str] = set()
        self.idle_seconds = 0.0
        self._idle_before_step = 0.0  # starved wait since the last step, for StepTiming
        self.stats: EngineStats = engine.stats()  # replaced (not mutated) after every step
        # The loop died (a bug, or an engine that failed MAX_FAILED_STEPS steps in a row):
        # nothing will serve requests any more, and the server shuts down
        # (services/server/server.py).
        self.crashed = False
        self._failed_steps = 0  # consecutive engine.step failures

    def run(self) -> None:
        """Thread entry: the event loop, with fatal errors logged and reported."""
        try:
            self.event_loop()
        except EngineBroken as exc:  # each failed step was logged with its traceback
            self.crashed = True  # stage 1 stops submitting (Pipeline._submit checks it)
            log.error("step loop stopped: the engine is broken", reason=str(exc))
            self._fail_queued()
        except BaseException:
            self.crashed = True
            log.exception("step loop died")
            self._fail_all(FailureKind.ENGINE_FAULT, "the step loop stopped on an internal error")
            raise

    def event_loop(self) -> None:
        while True:
            for msg in self._receive():
                if isinstance(msg, Shutdown):
                    self._fail_all(FailureKind.UNAVAILABLE, "the server is shutting down")
                    return
                self._dispatch(msg)
            outputs, start, end = self._step() if self._in_flight else ((), None, None)
            self.stats = self._snapshot()
            now = time.monotonic()
            timing = self._timing() if start is not None else None
            self._send(StepOutputs(outputs, start or now, end or now, self.stats, timing))
            self._publish_cache(now)

    def _receive(self) -> list[Inbound]:
        """Everything queued; blocks for the first message only when nothing is in flight."""
        msgs: list[Inbound] = []
        if not self._in_flight:
            msgs.append(self._wait())
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _wait(self) -> Inbound:
        waited_from = time.monotonic()
        msg = self._inbox.get()
        now = time.monotonic()
        since = self._active_since()
        if since is not None:
            idle = now - max(waited_from, since)
            self.idle_seconds += idle
            self._idle_before_step += idle
        return msg

    def _timing(self) -> StepTiming | None:
        """The engine's record of the step just run, with the wait before it."""
        timing = self._engine.last_step_timing
        idle, self._idle_before_step = self._idle_before_step, 0.0
        return None if timing is None else dataclasses.replace(timing, idle_s=idle)

    def _dispatch(self, msg: AddRequest | Abort | FlushPrefixCache) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, FlushPrefixCache):
            self._flush(msg.flush_id)
        elif msg.request_id in self._in_flight:
            self._in_flight.discard(msg.request_id)
            self._abort(msg.request_id)

    def _add(self, req: AddRequest) -> None:
        try:
            self._engine.add_request(
                req.request_id,
                list(req.prompt_token_ids),
                req.params,
                priority=req.priority,
                arrival_time=req.arrival_time,
                fork_of=req.fork_of,
                cache_salt=req.cache_salt,
            )
        except FieldError as exc:
            kind = FailureKind.INVALID_ARGUMENT
            self._send(RequestFailed(req.request_id, kind, exc.rule, exc.field))
        except Exception:
            log.exception("engine.add_request failed", request_id=req.request_id)
            self._send(RequestFailed(req.request_id, FailureKind.ENGINE_FAULT, FAULT_MESSAGE))
        else:
            self._in_flight.add(req.request_id)

    def _flush(self, flush_id: int) -> None:
        """Drop the prefix cache; the removals go out before the answer."""
        try:
            freed, unpublished = self._engine.flush_prefix_cache()
        except Exception as exc:
            log.exception("flushing the prefix cache failed")
            self._hand_off(CacheFlushed(flush_id, 0, 0, error=str(exc) or type(exc).__name__))
            return
        self._publish_cache(time.monotonic())
        self._hand_off(CacheFlushed(flush_id, freed, unpublished))

    def _publish_cache(self, now: float) -> None:
        """This turn's prefix-cache events and the stats after it, to the KV-event hub."""
        if self._publish is not None:
            events = self._engine.take_kv_events()
            self._hand_off(CacheUpdate(events, self.stats, now, bool(self._in_flight)))

    def _hand_off(self, record: Published) -> None:
        if self._publish is None:
            return
        try:
            self._publish(record)
        except Exception:  # a broken subscriber side must not stop the engine
            log.exception("publishing to the KV-event hub failed")

    def _abort(self, request_id: str) -> None:
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("engine.abort failed", request_id=request_id)

    def _step(self) -> tuple[tuple[RequestOutput, ...], float, float]:
        start = time.monotonic()
        try:
            outs = self._engine.step()
        except Exception as exc:
            log.exception("engine.step failed", num_requests=len(self._in_flight))
            self._fail_all(FailureKind.ENGINE_FAULT, FAULT_MESSAGE)
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                message = f"engine.step failed {self._failed_steps} times in a row"
                raise EngineBroken(message) from exc
            return (), start, time.monotonic()
        self._failed_steps = 0
        end = time.monotonic()
        for request_id, message in self._engine.take_failed():
            if request_id in self._in_flight:
                self._in_flight.discard(request_id)
                self._send(RequestFailed(request_id, FailureKind.ENGINE_FAULT, message))
        for out in outs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        if not outs and not self._engine.has_unfinished():
            # The engine dropped requests without finishing them; don't spin on them.
            self._fail_all(FailureKind.ENGINE_FAULT, "the engine lost the request")
        return tuple(outs), start, end

    def _snapshot(self) -> EngineStats:
        try:
            return self._engine.stats()
        except Exception:
            log.exception("engine.stats failed")
            return self.stats

    def _fail_queued(self) -> None:
        """Answer the requests still in the inbox: no step will run them. (One submitted in
        the instant between its crash check and this drain ends with the server's drain.)"""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequest):
                kind = FailureKind.UNAVAILABLE
                self._send(RequestFailed(msg.request_id, kind, "the engine is broken"))

    def _fail_all(self, kind: FailureKind, message: str) -> None:
        """Abort every request in flight and tell stage 3 why each one ended."""
        for request_id in sorted(self._in_flight):
            self._abort(request_id)
            self._send(RequestFailed(request_id, kind, message))
        self._in_flight.clear()


def run_step_loop(loop: StepLoop) -> threading.Thread:
    """Start stage 2 on its own named daemon thread."""
    thread = threading.Thread(target=loop.run, name="headrace-step-loop", daemon=True)
    thread.start()
    return thread

"""W3C trace context in the request's log lines, and the per-request tracing interface.

The servicers wrap each request in ``tracer.request(request_id, metadata)`` and iterate its
events through ``trace.watch(events)``. Two tracers implement that:

- ``LogTracer`` (the default: tracing off) never imports OpenTelemetry. When the call
  carries a valid ``traceparent`` it binds the caller's ``trace_id`` and ``parent_span_id``
  to the request's log lines (structlog contextvars); ``watch`` hands the events back
  untouched, so a request pays one scan of its metadata and nothing per token.
- ``services.telemetry.tracing.SpanTracer`` (``--otlp-endpoint``): a span per request, phase spans,
  and ``trace_id``/``span_id`` of that span in the log lines.

An invalid ``traceparent`` is ignored, as the W3C spec says (a new trace starts).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

TRACEPARENT = "traceparent"
# version "-" trace-id "-" parent-id "-" flags, lowercase hex; later versions may append
# "-"-separated fields, version 00 may not; version ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclass(frozen=True)
class TraceParent:
    trace_id: str  # 32 lowercase hex digits
    parent_id: str  # 16 lowercase hex digits: the caller's span
    flags: int  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(value: str) -> TraceParent | None:
    """The W3C ``traceparent`` header's fields, or None when it is not valid."""
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def traceparent_of(metadata: Iterable | None) -> TraceParent | None:
    """The call's parsed ``traceparent`` metadata, if it has a valid one."""
    for item in metadata or ():
        if item[0] == TRACEPARENT and isinstance(item[1], str):
            return parse_traceparent(item[1])
    return None


class RequestTrace(Protocol):
    def watch(self, events: AsyncIterator) -> AsyncIterator:
        """The request's events, passed through (and observed, when tracing)."""
        ...


class RequestTracer(Protocol):
    def request(
        self, request_id: str, metadata: Iterable | None
    ) -> contextlib.AbstractContextManager[RequestTrace]:
        """Scope of one request: its log lines carry the trace ids inside it."""
        ...


class _Untraced(contextlib.AbstractContextManager):
    """The scope of an untraced request, itself its trace: one shared, stateless object."""

    def __enter__(self) -> _Untraced:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def watch(self, events: AsyncIterator) -> AsyncIterator:
        return events


UNTRACED = _Untraced()


class LogTracer:
    """Tracing off: the caller's trace context goes to the logs only."""

    def request(
        self, request_id: str, metadata: Iterable | None
    ) -> contextlib.AbstractContextManager[RequestTrace]:
        parent = traceparent_of(metadata)
        return UNTRACED if parent is None else _logged(parent)


@contextlib.contextmanager
def _logged(parent: TraceParent) -> Iterator[RequestTrace]:
    with structlog.contextvars.bound_contextvars(
        trace_id=parent.trace_id, parent_span_id=parent.parent_id
    ):
        yield UNTRACED

"""OpenTelemetry tracing (``--otlp-endpoint``): a span per request and one per phase.

Imported only when tracing is on (services/telemetry/tracing_config.py decides), so a server
without it never loads OpenTelemetry. What a traced request produces:

    /headrace.v1.GenerationService/Generate   SERVER, the gRPC instrumentation's span: its
      │                                        parent is the caller's ``traceparent``
      └─ generate                              one per request (GenerateBatch: one each)
           ├─ tokenize  arrival -> tokenized (stage 1)
           ├─ queue     tokenized -> first scheduled by the step loop
           ├─ prefill   first scheduled -> first token
           ├─ decode    first token -> last token
           └─ stream    first event handed to the servicer -> the last one sent

The phases run on other threads (the tokenize pool, the step loop, the output pool), and
the step loop must never do per-request work it can skip, so the phase spans are not
live: they are written when the request ends, on the event loop, from the timestamps the
pipeline already records for the metrics (``Complete.timing``). A failed or cancelled
request has no phases, only its ``generate`` span with the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode

from services import rpc
from services.domain import Complete, RequestError, Timing

DEFAULT_SERVICE_NAME = "headrace"

try:
    from importlib.metadata import version

    _VERSION = version("headrace")
except Exception:  # not installed as a distribution (a bare checkout)
    _VERSION = "unknown"


class Tracing:
    """The tracer provider, its exporter, the gRPC interceptor and the request tracer."""

    def __init__(self, exporter: SpanExporter, batch: bool = True) -> None:
        resource = Resource.create()
        if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.provider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.interceptor = aio_server_interceptor(self.provider, filter_=_traced)
        self.requests = SpanTracer(self.provider.get_tracer("headrace", _VERSION))

    @classmethod
    def otlp(cls, endpoint: str | None) -> Tracing:
        """Export over OTLP/gRPC; ``None`` = the standard OTEL_EXPORTER_OTLP_* variables."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint))

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter."""
        self.provider.shutdown()


class SpanTracer:
    """``RequestTracer`` (services/telemetry/trace_context.py) with OpenTelemetry spans."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    @contextlib.contextmanager
    def request(self, request_id: str, metadata: Iterable | None) -> Iterator[SpanTrace]:
        # The parent is the current span: the gRPC instrumentation's, which took the
        # caller's traceparent/tracestate from the metadata (so ``metadata`` is not read).
        span = self._tracer.start_span(
            "generate", attributes={"headrace.request_id": request_id}, record_exception=False
        )
        ids = span.get_span_context()
        request = SpanTrace(self._tracer, span)
        with (
            trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ),
            _bound_ids(ids) if ids.is_valid else contextlib.nullcontext(),  # OTEL_SDK_DISABLED
        ):
            try:
                yield request
            except RequestError as exc:
                request.fail(exc.code, str(exc))
                raise
            except (asyncio.CancelledError, GeneratorExit):
                # The client went away or its deadline passed: not the server's failure.
                span.add_event("cancelled")
                raise
            except Exception:
                request.fail("INTERNAL", "internal error")  # the status mapping logs it
                raise
            finally:
                request.end()


class SpanTrace:
    """One request's ``generate`` span; its phases are written at the end."""

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span
        self._first_response: int | None = None  # time.time_ns()
        self._complete: Complete | None = None
        self._events = 0  # events handed on: (coalesced) chunks and the final one

    async def watch(self, events: AsyncIterator) -> AsyncIterator:
        async for event in events:
            if self._first_response is None:
                self._first_response = time.time_ns()
            self._events += 1
            if isinstance(event, Complete):
                self._complete = event
            yield event

    def fail(self, code: str, message: str) -> None:
        self._span.set_attribute("error.type", code)
        self._span.set_status(Status(StatusCode.ERROR, f"{code}: {message}" if message else code))

    def end(self) -> None:
        now = time.time_ns()
        complete = self._complete
        if complete is not None and self._span.is_recording():
            self._span.set_attributes(_usage_attributes(complete))
            self._phases(complete.timing, now)
        self._span.end(now)

    def _phases(self, timing: Timing, now: int) -> None:
        at = _wall_clock()
        tokenized = timing.arrival + timing.tokenize_seconds
        scheduled = timing.arrival + max(timing.queue_seconds, timing.tokenize_seconds)
        first_token = timing.arrival + timing.time_to_first_token_seconds
        last_token = timing.arrival + timing.total_seconds
        parent = trace.set_span_in_context(self._span)
        for name, start, end in (
            ("tokenize", at(timing.arrival), at(tokenized)),
            ("queue", at(tokenized), at(scheduled)),
            ("prefill", at(scheduled), at(first_token)),
            ("decode", at(first_token), at(last_token)),
            ("stream", self._first_response or now, now),
        ):
            span = self._tracer.start_span(name, parent, start_time=start)
            if name == "stream":
                span.set_attribute("headrace.stream.events", self._events)
            span.end(max(start, end))


def _usage_attributes(complete: Complete) -> dict:
    usage = complete.usage
    return {
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_prompt_tokens,
        "gen_ai.response.finish_reasons": [str(complete.finish_reason)],
    }


def _wall_clock() -> Callable[[float], int]:
    """time.monotonic() seconds -> time.time_ns(), by one offset (so the order is kept)."""
    offset = time.time_ns() - round(time.monotonic() * 1e9)
    return lambda t: offset + round(t * 1e9)


@contextlib.contextmanager
def _bound_ids(ids: trace.SpanContext) -> Iterator[None]:
    trace_id, span_id = format(ids.trace_id, "032x"), format(ids.span_id, "016x")
    with structlog.contextvars.bound_contextvars(trace_id=trace_id, span_id=span_id):
        yield


def _traced(details: grpc.HandlerCallDetails) -> bool:
    return rpc.traced(details.method)

"""The headrace.v1 GenerationService: convert protobuf -> domain, delegate to the pipeline,
convert events back.

Errors are raised as ``RequestError`` and mapped to status codes by
services/server/status.py. A cancelled call (client cancel, disconnect, deadline)
cancels the handler's coroutine; ``aclosing`` then closes the pipeline's
generator at once, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterable
from functools import partial
from typing import TYPE_CHECKING

import grpc

from compute.core.errors import FieldError
from services.api import convert
from services.api.input_limits import (
    DEFAULT_MAX_BATCH_REQUESTS,
    InputLimits,
    check_input,
    check_request_size,
)
from services.domain import MAX_REQUEST_ID_CHARS, GenerateInput, RequestError
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc
from services.pipeline.calls import counting_rejection, logged
from services.pipeline.fan_in import fan_in
from services.security.cache_isolation import SHARED, CacheIsolation
from services.telemetry.metrics import NO_METRICS, Metrics
from services.telemetry.trace_context import LogTracer

if TYPE_CHECKING:  # the servicer only needs the pipeline's interface
    from services.pipeline.pipeline import Pipeline
    from services.telemetry.trace_context import RequestTrace, RequestTracer

REQUEST_ID_METADATA = "x-request-id"


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """headrace.v1.GenerationService over a started Pipeline."""

    def __init__(
        self,
        pipeline: Pipeline,
        limits: InputLimits = InputLimits(),
        max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS,
        metrics: Metrics = NO_METRICS,
        tracer: RequestTracer | None = None,  # None: the caller's trace ids in the logs only
        isolation: CacheIsolation = SHARED,  # whose prefix cache a call uses
    ) -> None:
        self._pipeline = pipeline
        self._limits = limits
        self._max_batch_requests = max_batch_requests
        self._metrics = metrics
        self._tracer = tracer or LogTracer()
        self._isolation = isolation

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or _call_request_id(context)
        # The request's scope (trace ids in its log lines, its span) covers validation too.
        with self._tracer.request(
            request_id[:MAX_REQUEST_ID_CHARS], context.invocation_metadata()
        ) as trace:
            with counting_rejection(self._metrics):
                check_input(request, self._limits)  # names the field, so first
                check_request_size(request, self._limits)
                inp = convert.to_input(request, request_id)
            inp = self._in_tenant(inp, context.invocation_metadata())
            async for event in self._events(inp, trace):
                yield pb.GenerateResponse(request_id=inp.request_id, **convert.event_fields(event))

    async def GenerateBatch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateBatchResponse]:
        with counting_rejection(self._metrics):
            inputs = self._batch_inputs(request, _call_request_id(context, fallback=""))
        metadata = context.invocation_metadata()
        inputs = [self._in_tenant(inp, metadata) for inp in inputs]
        streams = {inp.request_id: partial(self._traced, inp, metadata) for inp in inputs}
        async for i, event in fan_in(streams, _in_batch):
            yield pb.GenerateBatchResponse(
                request_id=inputs[i].request_id, index=i, **convert.event_fields(event)
            )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        check_input(request, self._limits)
        check_request_size(request, self._limits)
        args = convert.tokenize_args(request)
        try:
            token_ids, tokens = await self._pipeline.tokenize(**args)
        except FieldError as exc:
            raise exc.at(convert.request_field(exc.field)) from None
        return pb.TokenizeResponse(token_ids=token_ids, tokens=tokens)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return convert.model_info_to_pb(self._pipeline.model_info())

    def _in_tenant(self, inp: GenerateInput, metadata: Iterable | None) -> GenerateInput:
        tenant = self._isolation.tenant(metadata)
        return dataclasses.replace(inp, tenant=tenant) if tenant else inp

    async def _events(self, inp: GenerateInput, trace: RequestTrace) -> AsyncIterator:
        """The pipeline's events for one request, logged, with errors naming request fields
        (inside the request's ``tracer.request`` scope)."""
        async with contextlib.aclosing(self._pipeline.generate(inp)) as events:
            async for event in logged(inp.request_id, trace.watch(events), convert.request_field):
                yield event

    async def _traced(self, inp: GenerateInput, metadata: Iterable | None) -> AsyncIterator:
        """One request of a batch in a ``tracer.request`` scope of its own."""
        with self._tracer.request(inp.request_id, metadata) as trace:
            async for event in self._events(inp, trace):
                yield event

    def _batch_inputs(self, request: pb.GenerateBatchRequest, base_id: str) -> list[GenerateInput]:
        """Validated inputs of a batch; errors name ``requests[i].<field>``."""
        limit = self._max_batch_requests
        check_request_size(request, self._limits)
        if not request.requests:
            raise FieldError("requests", "must not be empty")
        if len(request.requests) > limit:
            raise FieldError("requests", f"at most {limit} (got {len(request.requests)})")
        inputs, seen = [], {}
        for i, item in enumerate(request.requests):
            request_id = item.request_id or (f"{base_id}-{i}" if base_id else str(uuid.uuid4()))
            if request_id in seen:
                raise FieldError(
                    f"requests[{i}].request_id", f"duplicate of requests[{seen[request_id]}]"
                )
            seen[request_id] = i
            try:
                check_input(item, self._limits)
                inputs.append(convert.to_input(item, request_id))
            except RequestError as exc:
                raise _in_batch(exc, i) from None
        return inputs


def _call_request_id(context: grpc.aio.ServicerContext, fallback: str | None = None) -> str:
    """The call's ``x-request-id`` metadata, else ``fallback``, else a new UUID."""
    for key, value, *_ in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA and value:
            return value
    return str(uuid.uuid4()) if fallback is None else fallback


def _in_batch(exc: RequestError, i: int) -> RequestError:
    """``exc`` as raised by request ``i`` of a batch: its field becomes ``requests[i].<field>``."""
    if isinstance(exc, FieldError):
        return exc.at(f"requests[{i}].{exc.field}")
    return type(exc)(f"requests[{i}]: {exc}")

"""The headrace.v1 GenerationService: convert protobuf -> domain, delegate to the pipeline,
convert events back.

Errors are raised as ``RequestError`` and mapped to status codes by
services/server/status.py. A cancelled call (client cancel, disconnect, deadline)
cancels the handler's coroutine; ``aclosing`` then closes the pipeline's
generator at once, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING

import grpc

from compute.core.errors import FieldError
from compute.log import get_logger
from services.api import convert
from services.api.convert import MAX_REQUEST_ID_CHARS
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc
from services.pipeline.domain import Complete, EngineFault, GenerateInput, RequestError
from services.pipeline.input_limits import check_input, check_request_size
from services.server.server_config import ServerConfig
from services.telemetry.metrics import NO_METRICS, Metrics
from services.telemetry.trace_context import LogTracer

if TYPE_CHECKING:  # the servicer only needs the pipeline's interface
    from services.pipeline.pipeline import Pipeline
    from services.telemetry.trace_context import RequestTrace, RequestTracer

REQUEST_ID_METADATA = "x-request-id"

log = get_logger(__name__)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """headrace.v1.GenerationService over a started Pipeline."""

    def __init__(
        self,
        pipeline: Pipeline,
        config: ServerConfig | None = None,
        metrics: Metrics = NO_METRICS,
        tracer: RequestTracer | None = None,  # None: the caller's trace ids in the logs only
    ) -> None:
        self._pipeline = pipeline
        self._config = config or ServerConfig()
        self._metrics = metrics
        self._tracer = tracer or LogTracer()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or _call_request_id(context)
        # The request's scope (trace ids in its log lines, its span) covers validation too.
        with self._tracer.request(
            request_id[:MAX_REQUEST_ID_CHARS], context.invocation_metadata()
        ) as trace:
            with self._counting_rejection():
                check_input(request, self._config.limits)  # names the field, so first
                check_request_size(request, self._config.limits)
                inp = convert.to_input(request, request_id)
            async for event in self._events(inp, trace):
                yield pb.GenerateResponse(request_id=inp.request_id, **convert.event_fields(event))

    async def GenerateBatch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateBatchResponse]:
        with self._counting_rejection():
            inputs = self._batch_inputs(request, _call_request_id(context, fallback=""))
        async for i, event in self._merged(inputs, context.invocation_metadata()):
            yield pb.GenerateBatchResponse(
                request_id=inputs[i].request_id, index=i, **convert.event_fields(event)
            )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        check_input(request, self._config.limits)
        check_request_size(request, self._config.limits)
        args = convert.tokenize_args(request)
        try:
            token_ids, tokens = await self._pipeline.tokenize(**args)
        except FieldError as exc:
            raise convert.renamed(exc) from None
        return pb.TokenizeResponse(token_ids=token_ids, tokens=tokens)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return convert.model_info_to_pb(self._pipeline.model_info())

    @contextlib.contextmanager
    def _counting_rejection(self) -> Iterator[None]:
        # The pipeline counts the requests it refuses; these never reach it.
        try:
            yield
        except FieldError:
            self._metrics.observe_rejected("invalid_argument")
            raise

    async def _events(self, inp: GenerateInput, trace: RequestTrace) -> AsyncIterator:
        """The pipeline's events for one request, logged, with errors naming request fields
        (inside the request's ``tracer.request`` scope)."""
        try:
            async with contextlib.aclosing(self._pipeline.generate(inp)) as events:
                async for event in trace.watch(events):
                    if isinstance(event, Complete):
                        log_complete(inp.request_id, event)
                    yield event
        except RequestError as exc:
            log.info("request failed", request_id=inp.request_id, code=exc.code, error=str(exc))
            if isinstance(exc, FieldError):
                raise convert.renamed(exc) from None
            raise

    def _batch_inputs(self, request: pb.GenerateBatchRequest, base_id: str) -> list[GenerateInput]:
        """Validated inputs of a batch; errors name ``requests[i].<field>``."""
        limit = self._config.max_batch_requests
        check_request_size(request, self._config.limits)
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
            with _naming_request(i):
                check_input(item, self._config.limits)
                inputs.append(convert.to_input(item, request_id))
        return inputs

    async def _merged(
        self, inputs: list[GenerateInput], metadata: Iterable | None
    ) -> AsyncIterator:
        """(index, event) of all requests as they come, once every request has started.

        Holding events back until each request has produced its first one means a request
        the pipeline rejects (too long a prompt, a full queue) fails the whole call before
        anything is streamed.
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(inputs))
        tasks = [
            asyncio.create_task(self._pump(i, inp, queue, metadata)) for i, inp in enumerate(inputs)
        ]
        try:
            held: list | None = []
            started, done = set(), 0
            while done < len(inputs):
                i, event = await queue.get()
                if isinstance(event, RequestError):
                    raise _in_batch(event, i)
                if event is None:
                    done += 1
                    continue
                started.add(i)
                if held is None:
                    yield i, event
                    continue
                held.append((i, event))
                if len(started) == len(inputs):
                    for item in held:
                        yield item
                    held = None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(
        self, i: int, inp: GenerateInput, queue: asyncio.Queue, metadata: Iterable | None
    ) -> None:
        # Each task owns its request's generator, so closing it never races the reader.
        try:
            with self._tracer.request(inp.request_id, metadata) as trace:
                async for event in self._events(inp, trace):
                    await queue.put((i, event))
            await queue.put((i, None))
        except RequestError as exc:
            await queue.put((i, exc))
        except Exception as exc:
            log.error("batch request failed", request_id=inp.request_id, exc_info=exc)
            await queue.put((i, EngineFault("internal error")))


def _call_request_id(context: grpc.aio.ServicerContext, fallback: str | None = None) -> str:
    """The call's ``x-request-id`` metadata, else ``fallback``, else a new UUID."""
    for key, value in _metadata(context.invocation_metadata()):
        if key == REQUEST_ID_METADATA and value:
            return value
    return str(uuid.uuid4()) if fallback is None else fallback


def _metadata(metadata: Iterable | None) -> Iterable[tuple[str, str]]:
    return ((item[0], item[1]) for item in metadata or ())


def _in_batch(exc: RequestError, i: int) -> RequestError:
    """``exc`` as raised by request ``i`` of a batch: its field becomes ``requests[i].<field>``."""
    if isinstance(exc, FieldError):
        return exc.at(f"requests[{i}].{exc.field}")
    return type(exc)(f"requests[{i}]: {exc}")


@contextlib.contextmanager
def _naming_request(i: int):
    try:
        yield
    except RequestError as exc:
        raise _in_batch(exc, i) from None


def log_complete(request_id: str, complete: Complete) -> None:
    usage, timing = complete.usage, complete.timing
    log.info(
        "request complete",
        request_id=request_id,
        finish_reason=complete.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        tokenize_s=round(timing.tokenize_seconds, 6),
        queue_s=round(timing.queue_seconds, 6),
        ttft_s=round(timing.time_to_first_token_seconds, 6),
        total_s=round(timing.total_seconds, 6),
    )

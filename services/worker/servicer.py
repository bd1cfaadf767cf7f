"""``vllm.grpc.engine.VllmEngine`` over a started Pipeline (what SMG calls on a worker).

Same pipeline, admission, drain gate and status mapping as headrace.v1 (the server
wraps both services with the same interceptors). Two ways to stop a request:
the stream is cancelled (grpc cancels the handler, ``aclosing`` closes the pipeline's
generator), or the gateway calls ``Abort(request_ids)`` -- SMG does that when its
HTTP client goes away and keeps reading the stream, so Abort must end the stream
itself: it stops the pipeline's generator (freeing the KV at the next step) and
sends a final GenerateComplete with finish_reason "abort".

The rest of the protocol: SubscribeKvEvents streams the prefix cache's stored and evicted
blocks with the engine's load (services/pipeline/kv_event_hub.py, kv_subscription.py;
services/worker/kv_event_convert.py), GetTokenizer the files a gateway tokenizes with
(services/worker/tokenizer_bundle.py), FlushCache drops the prefix cache through the step
loop, StartProfile/StopProfile sample the serving threads into ``--profile-dir``
(services/pipeline/thread_profiler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from compute.core.errors import FieldError
from kernels.log import get_logger
from services.domain import MAX_REQUEST_ID_CHARS, Chunk, Complete, GenerateInput, RequestError
from services.pipeline.calls import counting_rejection, logged
from services.pipeline.thread_profiler import ThreadProfiler
from services.security.cache_isolation import SHARED, CacheIsolation, metadata_salt
from services.telemetry.metrics import NO_METRICS, Metrics
from services.telemetry.trace_context import LogTracer
from services.worker import convert
from services.worker.operations import WorkerOperations

if TYPE_CHECKING:
    from services.pipeline.pipeline import Pipeline
    from services.telemetry.trace_context import RequestTrace, RequestTracer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# RPCs of the protocol headrace has no counterpart for; gateways treat UNIMPLEMENTED as
# "feature absent" (as SMG does for SubscribeKvEvents under --no-kv-events).
UNARY_UNIMPLEMENTED = ("Embed",)
STREAM_UNIMPLEMENTED = ()


class Unimplemented(RequestError):
    code = "UNIMPLEMENTED"


log = get_logger(__name__)


class WorkerServicer(pb_grpc.VllmEngineServicer):
    """The vLLM worker protocol; ``tokenizer_path`` is what GetModelInfo tells the gateway."""

    def __init__(
        self,
        pipeline: Pipeline,
        tokenizer_path: str,
        serving: Callable[[], bool] = lambda: True,
        metrics: Metrics = NO_METRICS,
        tracer: RequestTracer | None = None,  # None: the caller's trace ids in the logs only
        isolation: CacheIsolation = SHARED,  # whose prefix cache a call's request uses
        profiler: ThreadProfiler | None = None,  # --profile-dir; None: profiling refused
        kv_events: bool = True,  # --no-kv-events: SubscribeKvEvents is UNIMPLEMENTED
    ) -> None:
        self._pipeline = pipeline
        self._tokenizer_path = tokenizer_path
        self._serving = serving
        self._metrics = metrics
        self._tracer = tracer or LogTracer()
        self._isolation = isolation
        self._operations = WorkerOperations(pipeline, metrics, profiler)
        self._kv_events = kv_events
        self._aborts: dict[str, asyncio.Event] = {}
        self._started = time.time()
        self._last_receive = 0.0

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._last_receive = time.time()
        request_id = request.request_id[:MAX_REQUEST_ID_CHARS]
        # The request's scope (trace ids in its log lines, its span) covers validation too.
        with self._tracer.request(request_id, context.invocation_metadata()) as trace:
            inp = self._in_namespace(self._checked_input(request), context)
            aborted = self._aborts[inp.request_id] = asyncio.Event()
            try:
                async for response in self._responses(inp, request.stream, aborted, trace):
                    yield response
            finally:
                del self._aborts[inp.request_id]

    def _checked_input(self, request: pb.GenerateRequest) -> GenerateInput:
        with counting_rejection(self._metrics):
            inp = convert.to_input(request)
        if inp.request_id in self._aborts:
            raise FieldError("request_id", f"{inp.request_id!r} is already in flight")
        return inp

    def _in_namespace(self, inp: GenerateInput, context: grpc.aio.ServicerContext) -> GenerateInput:
        """The protocol has no cache-salt field: the call's ``x-cache-salt`` metadata names
        one, and the caller's token the tenant under --cache-isolation token."""
        metadata = context.invocation_metadata()
        salt, tenant = metadata_salt(metadata), self._isolation.tenant(metadata)
        return dataclasses.replace(inp, cache_salt=salt, tenant=tenant) if salt or tenant else inp

    async def _responses(
        self, inp: GenerateInput, stream: bool, aborted: asyncio.Event, trace: RequestTrace
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt_tokens = len(inp.token_ids or ())
        # Per sample (n > 1: the ``index`` of each message): streamed, all tokens so far;
        # unary, held for its Complete.
        sent: dict[int, list[int]] = {i: [] for i in range(inp.n)}
        logprobs: dict[int, list] = {i: [] for i in range(inp.n)}
        # Inner aclosing first: it stops reading ``events`` before the outer one closes it.
        # The pipeline names domain fields; logged names them by this protocol's paths.
        async with (
            contextlib.aclosing(self._pipeline.generate(inp)) as events,
            contextlib.aclosing(
                _until(logged(inp.request_id, trace.watch(events), convert.request_field), aborted)
            ) as guarded,
        ):
            async for event in guarded:
                if event is None:  # Abort(request_ids) named this request
                    log.info("request aborted by the gateway", request_id=inp.request_id)
                    for i in sorted(sent):  # every sample not complete yet
                        yield convert.aborted_pb(prompt_tokens, len(sent[i]), i)
                    return
                i = event.sample_index
                if isinstance(event, Chunk):
                    sent[i].extend(event.token_ids)
                    if stream:
                        yield convert.chunk_to_pb(event, prompt_tokens, len(sent[i]))
                    else:
                        logprobs[i].extend(event.logprobs)
                elif isinstance(event, Complete):
                    done = sent.pop(i)
                    yield convert.complete_to_pb(event, [] if stream else done, logprobs.pop(i))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        for request_id in request.request_ids:  # unknown ids have ended already: not an error
            event = self._aborts.get(request_id)
            if event is not None:
                event.set()
        return pb.AbortResponse()

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        if self._serving():
            return pb.HealthCheckResponse(healthy=True, message="serving")
        return pb.HealthCheckResponse(healthy=False, message="draining or stopped")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        info = self._pipeline.model_info()
        return pb.GetModelInfoResponse(
            model_path=self._tokenizer_path,
            tokenizer_path=self._tokenizer_path,
            served_model_name=info.model_name,
            is_generation=True,
            max_context_length=info.max_model_len,
            max_req_input_len=info.max_model_len - 1,
            vocab_size=info.vocab_size,
            # vLLM's message has no field for the architecture's deltas (sliding window,
            # RoPE type, soft-caps): headrace's own GetModelInfo reports them.
            model_type=info.architecture,
            architectures=[info.architecture],
            eos_token_ids=list(info.eos_token_ids),
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        info = self._pipeline.model_info()
        return pb.GetServerInfoResponse(
            active_requests=self._pipeline.num_pending,
            is_paused=not self._serving(),
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started,
            server_type="vllm-grpc",
            data_parallel_size=1,
            block_size=info.block_size,
            model_dtype=info.dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            # No reasoning parser: a request's grammar applies from its first token.
            constrained_decoding_start="first_token" if info.constraint_kinds else "",
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise FieldError("dp_rank", "headrace runs one data-parallel rank (0)")
        stats = self._pipeline.engine_stats()
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running,
            num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=stats.kv_slots_used,
            max_total_num_tokens=stats.num_blocks * stats.block_size,
            token_usage=stats.kv_usage,
        )
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return pb.GetLoadsResponse(
            timestamp=stamp, version="headrace", dp_rank_count=1, loads=[load]
        )

    # -- KV events, tokenizer, cache flush, profiling (services/worker/operations.py) -----

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        if not self._kv_events:  # gateways take UNIMPLEMENTED for "no events here"
            raise Unimplemented("KV events are off on this server (--no-kv-events)")
        # A resume point outside the history is refused before any header goes out: a
        # gateway reads only a call that fails at once as "resync" (OUT_OF_RANGE).
        subscription = self._operations.open_kv_events(request)
        try:
            await context.send_initial_metadata(())  # gateways wait for the headers first
            batches = self._operations.kv_event_batches(subscription)
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    yield batch
        finally:
            subscription.close()

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        for chunk in await self._operations.tokenizer_chunks():
            yield chunk

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        return await self._operations.flush_cache(request)

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._operations.start_profile(request)

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._operations.stop_profile()


def _unimplemented(name: str, stream: bool):
    async def unary(self, request, context):
        raise Unimplemented(f"{name} is not implemented by headrace")

    async def streaming(self, request, context):
        raise Unimplemented(f"{name} is not implemented by headrace")
        yield  # an async generator, as grpc expects of a server-streaming handler

    return streaming if stream else unary


# The generated base class answers these with NotImplementedError, which the status
# mapping would log as an internal error on every gateway poll.
for _name in UNARY_UNIMPLEMENTED:
    setattr(WorkerServicer, _name, _unimplemented(_name, stream=False))
for _name in STREAM_UNIMPLEMENTED:
    setattr(WorkerServicer, _name, _unimplemented(_name, stream=True))


async def _until(events: AsyncIterator, aborted: asyncio.Event) -> AsyncIterator:
    """``events`` until ``aborted`` is set; then one None, and ``events`` is left unread.

    The caller's ``aclosing`` then closes the pipeline's generator, which aborts the
    request in the engine (the same path as a cancelled stream).
    """
    waiter = asyncio.ensure_future(aborted.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait((step, waiter), return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                yield None
                return
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        waiter.cancel()
        if step is not None and not step.done():  # aborted, or the call itself was cancelled
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step

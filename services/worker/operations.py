"""The worker protocol beyond generation: KV events, the tokenizer, cache flush, profiling.

``WorkerOperations`` does what the servicer's SubscribeKvEvents, GetTokenizer, FlushCache,
StartProfile and StopProfile delegate to (services/worker/servicer.py): protocol messages
in, the pipeline's hub, stage 2 and the profiler behind, protocol messages out. Errors are
``RequestError``s the status mapping turns into codes: FAILED_PRECONDITION for what the
server was not set up for (no tokenizer, no ``--profile-dir``, a profile already running),
INVALID_ARGUMENT naming the field a request asks what cannot be done.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from smg_grpc_proto.generated import common_pb2 as pb

from compute.core.errors import FieldError
from kernels.log import get_logger
from services.domain import RequestError, Unavailable
from services.pipeline.kv_subscription import KvSubscription
from services.pipeline.thread_profiler import ThreadProfiler
from services.telemetry.metrics import NO_METRICS, Metrics
from services.worker import kv_event_convert
from services.worker.tokenizer_bundle import TokenizerBundle
from services.worker.tokenizer_export import tokenizer_files

if TYPE_CHECKING:
    from services.pipeline.pipeline import Pipeline

FLUSH_WAIT_S = 10.0  # at least this long for the step loop to answer a FlushCache

log = get_logger(__name__)


class FailedPrecondition(RequestError):
    code = "FAILED_PRECONDITION"


class WorkerOperations:
    """One per servicer: the tokenizer bundle is built once, at its first request."""

    def __init__(
        self,
        pipeline: Pipeline,
        metrics: Metrics = NO_METRICS,
        profiler: ThreadProfiler | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._profiler = profiler
        self._bundle: TokenizerBundle | None = None

    def open_kv_events(self, request: pb.SubscribeKvEventsRequest) -> KvSubscription:
        """A subscription (OUT_OF_RANGE for a resume point outside the history, at once)."""
        hub, early_loads = self._pipeline.kv_events, request.load_records_before_first_batch
        return KvSubscription(hub, request.start_sequence_number, early_loads, self._metrics)

    async def kv_event_batches(
        self, subscription: KvSubscription
    ) -> AsyncIterator[pb.KvEventBatch]:
        """Its batches, each with the engine's load as it is when sent."""
        load = self._pipeline.kv_events.load
        samples, event_ids = itertools.count(1), itertools.count(1)
        records = subscription.records()
        try:
            async for record in records:
                sample = load.sample()
                yield kv_event_convert.batch_to_pb(record, sample, next(samples), event_ids)
        finally:
            await records.aclose()

    async def tokenizer_chunks(self) -> list[pb.GetTokenizerChunk]:
        bundle = await self._tokenizer_bundle()
        return [pb.GetTokenizerChunk(data=data, sha256=sha) for data, sha in bundle.chunks()]

    async def _tokenizer_bundle(self) -> TokenizerBundle:
        if self._bundle is None:
            tokenizer = self._pipeline.tokenizer
            if tokenizer is None:
                raise FailedPrecondition(
                    "this model has no tokenizer (dummy weights): give the gateway --tokenizer-path"
                )
            max_len = self._pipeline.model_info().max_model_len
            files = await asyncio.to_thread(tokenizer_files, tokenizer, max_len)
            self._bundle = await asyncio.to_thread(TokenizerBundle.of, files)
        return self._bundle

    async def flush_cache(self, request: pb.FlushCacheRequest) -> pb.FlushCacheResponse:
        # Requests in flight keep their blocks (nothing is preempted), so there is no idle
        # scheduler to wait for: timeout_s only stretches the wait for stage 2's answer.
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            raise FieldError("timeout_s", "must be a finite number of seconds >= 0")
        try:
            done = await self._pipeline.flush_cache(max(request.timeout_s, FLUSH_WAIT_S))
        except TimeoutError:
            raise Unavailable("the step loop did not answer the flush in time") from None
        if done.error:
            raise RequestError(f"the flush failed: {done.error}")
        message = f"freed {done.num_freed} cached KV blocks"
        if done.num_unpublished:
            message += (
                f"; {done.num_unpublished} more are held by running requests, no longer "
                "reused, and freed when those end"
            )
        log.info("prefix cache flushed", freed=done.num_freed, unpublished=done.num_unpublished)
        return pb.FlushCacheResponse(success=True, message=message)

    async def start_profile(self, request: pb.StartProfileRequest) -> pb.ProfileResponse:
        profiler = self._checked_profiler()
        subdirectory = _profile_subdirectory(request)
        try:
            out = await asyncio.to_thread(profiler.start, subdirectory)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        log.info("profile started", directory=str(out))
        return pb.ProfileResponse(success=True, message=f"profiling into {out}")

    async def stop_profile(self) -> pb.ProfileResponse:
        profiler = self._checked_profiler()
        try:
            files = await asyncio.to_thread(profiler.stop)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        message = (
            f"{files.samples} samples over {files.seconds:.1f} s: {files.folded} "
            f"(collapsed stacks), {files.summary} (per-thread summary)"
        )
        return pb.ProfileResponse(success=True, message=message)

    def _checked_profiler(self) -> ThreadProfiler:
        if self._profiler is None:
            raise FailedPrecondition(
                "profiling is off on this server: start it with --profile-dir DIR"
            )
        return self._profiler


def _profile_subdirectory(request: pb.StartProfileRequest) -> str:
    """Where under --profile-dir the caller asked for (a relative path inside it), after
    refusing what a sampler of thread stacks cannot do (INVALID_ARGUMENT naming it)."""
    for field in ("start_step", "num_steps"):
        if request.HasField(field):
            raise FieldError(
                field, "not supported: a profile runs from StartProfile to StopProfile"
            )
    unknown = [a for a in request.activities if a.upper() != "CPU"]
    if unknown:
        raise FieldError("activities", f"only CPU (sampled thread stacks) is recorded: {unknown}")
    if not request.output_dir:
        return ""
    path = Path(request.output_dir)
    if path.is_absolute() or ".." in path.parts:
        raise FieldError("output_dir", "must be a relative path inside the server's --profile-dir")
    return str(path)

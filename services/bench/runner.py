"""Sends a workload over one asyncio gRPC channel and records every chunk's arrival time.

Each request's record keeps the raw client timestamps (send, every chunk carrying tokens
with its token count, end) so that stats.py derives every metric from them and a test can
recompute the metrics independently. Failures are kept too, by gRPC status code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from services.bench.workload import BenchRequest
from services.client.client import CHANNEL_OPTIONS, generate_request
from services.client.client_security import ClientSecurity
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class RequestRecord:
    """What one request did, in seconds of time.perf_counter() (relative to the run's start)."""

    index: int
    send: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0  # tokens received in chunks
    cached_prompt_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None  # gRPC status code name, or "NO_COMPLETE"
    server_ttft: float | None = None
    server_queue: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class RunSettings:
    """How to send: mean request rate (inf = at once), burstiness, in-flight cap, ignore_eos."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    temperature: float
    seed: int
    security: ClientSecurity = field(default_factory=ClientSecurity)  # TLS and token


def to_proto(req: BenchRequest, index: int, tag: str, settings: RunSettings) -> pb.GenerateRequest:
    message = generate_request(
        req.prompt,
        chat=req.chat,
        token_ids=req.token_ids,
        temperature=settings.temperature,
        max_tokens=req.max_tokens,
        seed=settings.seed + index,
        request_id=f"{tag}-{index}",
    )
    message.stopping.ignore_eos = settings.ignore_eos
    return message


async def _one(
    stub: pb_grpc.GenerationServiceStub,
    message: pb.GenerateRequest,
    record: RequestRecord,
    t0: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> None:
    record.send = time.perf_counter() - t0
    try:
        async for response in stub.Generate(message, metadata=metadata):
            now = time.perf_counter() - t0
            if response.HasField("complete"):
                _complete(record, response.complete)
            elif response.chunk.token_ids:
                record.chunks.append((now, len(response.chunk.token_ids)))
                record.output_tokens += len(response.chunk.token_ids)
        if not record.finish_reason:
            record.error = "NO_COMPLETE"
    except grpc.aio.AioRpcError as exc:
        record.error = exc.code().name
    record.end = time.perf_counter() - t0


def _complete(record: RequestRecord, complete: pb.Complete) -> None:
    record.finish_reason = pb.FinishReason.Name(complete.finish_reason)
    record.prompt_tokens = complete.usage.prompt_tokens
    record.cached_prompt_tokens = complete.usage.cached_prompt_tokens
    record.server_ttft = complete.timing.time_to_first_token_seconds
    record.server_queue = complete.timing.queue_seconds


async def run_workload(
    target: str,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    settings: RunSettings,
    tag: str = "bench",
    on_done: Callable[[RequestRecord], None] | None = None,
    t0: float | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests[i]`` at ``offsets[i]`` seconds after ``t0`` (a time.perf_counter()
    value, default now); (records, seconds from the first send to the last end)."""
    gate = asyncio.Semaphore(settings.max_concurrency or len(requests) or 1)
    records = [RequestRecord(i, 0.0) for i in range(len(requests))]
    async with settings.security.aio_channel(target, CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        t0 = time.perf_counter() if t0 is None else t0

        async def timed(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                message = to_proto(requests[i], i, tag, settings)
                await _one(stub, message, records[i], t0, settings.security.metadata)
            if on_done is not None:
                on_done(records[i])

        await asyncio.gather(*(timed(i) for i in range(len(requests))))
    first = min((r.send for r in records), default=0.0)
    last = max((r.end or 0.0 for r in records), default=0.0)
    return records, max(0.0, last - first)

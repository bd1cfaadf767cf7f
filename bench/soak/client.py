"""Sends the soak's requests over one asyncio gRPC channel and records how each ended.

Requests go out as raw bytes (soak_requests.py builds them, malformed ones included) at
the times of an arrival process: Poisson / gamma at ``rate`` (services/bench/arrivals.py),
or back to back when the rate is infinite, capped by ``max_concurrency`` in flight. Each
record keeps the client timestamps a latency needs (send, first token, end; seconds
since the run's ``t0``) and the status code and message it got.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from bench.soak.requests import Planned
from services.bench.arrivals import arrival_offsets
from services.client.client import CHANNEL_OPTIONS
from services.gen.headrace.v1 import generation_pb2 as pb

SERVICE = "/headrace.v1.GenerationService/"
# The oversized prompts are up to ~12 MiB: let them reach the server, which must refuse them.
OPTIONS = [*CHANNEL_OPTIONS, ("grpc.max_send_message_length", 17 * 1024 * 1024)]
DETAILS_CHARS = 200  # what a record keeps of a status message


@dataclass(slots=True)
class SoakRecord:
    """One request: what it was, when, and how it ended."""

    index: int
    kind: str
    variant: str
    send: float
    end: float = 0.0
    first_token: float | None = None
    output_tokens: int = 0
    code: str = ""  # status code name; "NO_COMPLETE" for a stream that ended without one
    details: str = ""  # its message, capped
    details_chars: int = 0  # the message's full length
    expected: bool = False  # soak_summary.classify() sets it


async def send(call, plan: Planned, record: SoakRecord, t0: float) -> None:
    """Run one planned request into ``record`` (never raises for an RPC outcome)."""
    record.send = time.perf_counter() - t0
    try:
        if plan.method == "Generate":
            await _stream(call, plan, record, t0)
        else:
            await call(plan.payload, timeout=plan.timeout)
            record.code = "OK"
    except grpc.aio.AioRpcError as exc:
        record.code = exc.code().name
        details = exc.details() or ""
        record.details, record.details_chars = details[:DETAILS_CHARS], len(details)
    record.end = time.perf_counter() - t0


async def _stream(call, plan: Planned, record: SoakRecord, t0: float) -> None:
    stream = call(plan.payload, timeout=plan.timeout)
    chunks = 0
    complete = False
    async for response in stream:
        if response.HasField("complete"):
            complete = True
            continue
        if response.chunk.token_ids:
            if record.first_token is None:
                record.first_token = time.perf_counter() - t0
            record.output_tokens += len(response.chunk.token_ids)
        chunks += 1
        if plan.cancel_after is not None and chunks >= plan.cancel_after:
            stream.cancel()
            record.code = "CANCELLED"
            return
    record.code = "OK" if complete else "NO_COMPLETE"


def _offsets(rate: float, burstiness: float, duration: float, seed: int) -> Iterator[float]:
    if math.isinf(rate):
        return itertools.repeat(0.0)
    # Enough arrivals for the duration with room to spare (a gamma process can run ahead).
    return iter(arrival_offsets(int(rate * duration * 2) + 100, rate, burstiness, seed))


async def drive(
    target: str,
    next_plan: Callable[[], Planned],
    duration: float,
    rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    t0: float | None = None,
    on_record: Callable[[SoakRecord], None] | None = None,
    finish_timeout: float = 120.0,
) -> list[SoakRecord]:
    """Send planned requests for ``duration`` seconds, then wait (up to ``finish_timeout``)
    for those in flight; the records in send order."""
    t0 = time.perf_counter() if t0 is None else t0
    start = time.perf_counter() - t0
    gate = asyncio.Semaphore(max_concurrency or sys.maxsize)  # no cap: never waits
    records: list[SoakRecord] = []
    tasks: set[asyncio.Task] = set()
    async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
        calls = {
            "Generate": channel.unary_stream(
                SERVICE + "Generate", response_deserializer=pb.GenerateResponse.FromString
            ),
            "Tokenize": channel.unary_unary(SERVICE + "Tokenize"),
        }

        async def one(plan: Planned, record: SoakRecord) -> None:
            try:
                await send(calls[plan.method], plan, record, t0)
            finally:
                gate.release()
            if on_record is not None:
                on_record(record)

        for offset in _offsets(rate, burstiness, duration, seed):
            delay = start + offset - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            if time.perf_counter() - t0 >= start + duration:
                gate.release()
                break
            plan = next_plan()
            record = SoakRecord(len(records), plan.kind, plan.variant, 0.0)
            records.append(record)
            task = asyncio.create_task(one(plan, record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=finish_timeout)
        for task in list(tasks):  # still running after the wait: recorded as such
            task.cancel()
    for record in records:
        if not record.code:
            record.code, record.end = "CLIENT_GAVE_UP", time.perf_counter() - t0
    return records

"""Many requests' event streams as one (headrace.v1's GenerateBatch).

Each request runs in a task of its own (it owns its stream, so closing one never races
the reader); their events come out as ``(index, event)`` in arrival order, but only once
every request has produced its first event, so a request the pipeline rejects (too long
a prompt, a full queue) fails the whole call before anything is streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kernels.log import get_logger
from services.domain import EngineFault, RequestError

log = get_logger(__name__)

Stream = Callable[[], AsyncIterator]


async def fan_in(
    streams: dict[str, Stream], failed: Callable[[RequestError, int], RequestError]
) -> AsyncIterator[tuple[int, object]]:
    """(index, event) of every request's stream (by request id, in order); the first
    failure, as ``failed(exc, index)``, ends them all."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(streams))
    tasks = [
        asyncio.create_task(_pump(i, request_id, stream, queue))
        for i, (request_id, stream) in enumerate(streams.items())
    ]
    try:
        held: list | None = []
        started, done = set(), 0
        while done < len(streams):
            i, event = await queue.get()
            if isinstance(event, RequestError):
                raise failed(event, i)
            if event is None:
                done += 1
                continue
            started.add(i)
            if held is None:
                yield i, event
                continue
            held.append((i, event))
            if len(started) == len(streams):
                for item in held:
                    yield item
                held = None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(i: int, request_id: str, stream: Stream, queue: asyncio.Queue) -> None:
    try:
        async for event in stream():
            await queue.put((i, event))
        await queue.put((i, None))
    except RequestError as exc:
        await queue.put((i, exc))
    except Exception as exc:
        log.error("batch request failed", request_id=request_id, exc_info=exc)
        await queue.put((i, EngineFault("internal error")))

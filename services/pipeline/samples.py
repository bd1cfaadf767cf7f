"""n > 1: several samples of one prompt, as one stream of events tagged with their index.

Each sample is an engine request of its own (its own sequence, seed and finish), and the
prompt is computed once: sample 0 is tokenized and admitted first, and the others are
admitted only once sample 0 has produced its first token, when its prompt is computed.
Each of them names sample 0 as the sequence it forks from (``AddRequest.fork_of``): the
scheduler (compute/core/scheduler.py) gives it sample 0's full prompt KV blocks by
reference and a copy of the partial last one, so it computes only the prompt's last
token, for its own logits to sample its first token from -- the prompt costs one
computation plus one token per extra sample, with prefix caching on or off (their
``cached_prompt_tokens`` say prompt length - 1). If sample 0 has finished or been
preempted by then, a sample is admitted as any request (prefix-cache hits, or the whole
prompt). They share sample 0's tokenized request too: the prompt is tokenized once.

- Seeds: with ``seed`` = s, sample i draws from its own generator seeded s + i, so each
  sample is reproducible alone, and sample 0 is the request run with n = 1.
- Events come out as the GenerateBatch fan-in gives them (services/pipeline/fan_in.py):
  interleaved, each with its ``sample_index``; one Complete per sample; nothing before
  every sample has started, so a refusal fails the whole call before anything streams.
- Cancelling (closing the stream) cancels every sample, each aborted in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from compute.core.errors import FieldError, RequestError
from compute.core.messages import AddRequest
from services.domain import Chunk, Complete, GenerateInput
from services.pipeline.fan_in import fan_in

MAX_SEED = 2**63

# prepare(request_id, arrival) -> the request to submit
Prepare = Callable[[str, float], Awaitable[AddRequest]]
# one(prepare) -> that request's events (the pipeline's single-request stream)
OneStream = Callable[[Prepare], AsyncIterator[Chunk | Complete]]


def check_samples(inp: GenerateInput, max_n: int) -> None:
    """FieldError naming ``n`` (or ``seed``) unless the request's n can be served."""
    if not 1 <= inp.n <= max_n:
        raise FieldError("n", f"must be in [1, {max_n}] (got {inp.n})")
    seed = inp.params.seed
    if seed is not None and seed + inp.n - 1 >= MAX_SEED:
        raise FieldError("seed", "seed + n - 1 must be below 2^63 (sample i draws seed + i)")


async def generate_samples(
    inp: GenerateInput, prepare: Prepare, one: OneStream
) -> AsyncIterator[Chunk | Complete]:
    """The events of ``inp.n`` samples, each tagged with its sample_index."""
    shared = _SharedPrompt(prepare)
    streams = {str(i): _sample_stream(i, shared, inp, one) for i in range(inp.n)}
    async for i, event in fan_in(streams, lambda exc, i: exc):
        yield dataclasses.replace(event, sample_index=i)


class _SharedPrompt:
    """Sample 0's request, and whether its prompt is in the cache yet."""

    def __init__(self, prepare: Prepare) -> None:
        self._prepare = prepare
        self.first: AddRequest | None = None
        self.ready = asyncio.Event()  # sample 0 produced its first event, or ended

    async def prepare_first(self, request_id: str, arrival: float) -> AddRequest:
        self.first = await self._prepare(request_id, arrival)
        return self.first

    async def prepare_other(self, index: int, request_id: str, arrival: float) -> AddRequest:
        await self.ready.wait()
        if self.first is None:  # sample 0 failed before it was tokenized: so will this one
            raise RequestError("the first sample of this request failed")
        params = self.first.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        return dataclasses.replace(
            self.first,
            request_id=request_id,
            arrival_time=arrival,
            params=params,
            fork_of=self.first.request_id,
        )


def _sample_stream(
    index: int, shared: _SharedPrompt, inp: GenerateInput, one: OneStream
) -> Callable[[], AsyncIterator[Chunk | Complete]]:
    async def first() -> AsyncIterator[Chunk | Complete]:
        try:
            async for event in one(shared.prepare_first):
                shared.ready.set()
                yield event
        finally:
            shared.ready.set()

    def other() -> AsyncIterator[Chunk | Complete]:
        return one(lambda request_id, arrival: shared.prepare_other(index, request_id, arrival))

    return first if index == 0 else other

"""Bounded per-stream buffering: a reader slower than generation gets coalesced chunks
(every token, in order, in fewer messages), and a stream never holds more than one
pending chunk plus its final event."""

from __future__ import annotations

import asyncio

from compute.core.messages import TokenLogprob
from compute.core.sampling_params import SamplingParams
from services.domain import Chunk, Complete, GenerateInput
from services.pipeline.request_state import RequestStream
from tests.conftest import SCRIPT_TEXT
from tests.service.test_pipeline import running
from tests.support.fake_engine import FakeEngine, smollm2_tokenizer


def _chunk(i: int) -> Chunk:
    lp = TokenLogprob(i, -0.5, ((i, -0.5),))
    return Chunk(f"t{i} ", (i,), (lp,), (f"t{i}",), ((f"t{i}",),))


def test_pending_chunks_are_coalesced_in_order() -> None:
    async def scenario() -> list:
        stream = RequestStream(asyncio.get_running_loop())
        for i in range(1000):
            stream.put(_chunk(i))
            assert stream.num_pending == 1
        stream.put(Complete.__new__(Complete))  # any final event
        assert stream.num_pending == RequestStream.MAX_PENDING
        return [await stream.get(), await stream.get()]

    merged, final = asyncio.run(scenario())
    assert merged.token_ids == tuple(range(1000))
    assert merged.text == "".join(f"t{i} " for i in range(1000))
    assert [lp.token_id for lp in merged.logprobs] == list(range(1000))
    assert merged.tokens == tuple(f"t{i}" for i in range(1000))
    assert len(merged.top_tokens) == 1000
    assert isinstance(final, Complete)


def test_a_fast_reader_gets_one_chunk_per_step() -> None:
    async def scenario() -> list:
        stream = RequestStream(asyncio.get_running_loop())
        got = []
        for i in range(5):
            stream.put(_chunk(i))
            got.append(await stream.get())
        return got

    assert [c.token_ids for c in asyncio.run(scenario())] == [(i,) for i in range(5)]


def test_a_slow_reader_gets_every_token_in_fewer_chunks() -> None:
    tok = smollm2_tokenizer()
    script = tok.encode(SCRIPT_TEXT)
    engine = FakeEngine(tok, script, step_delay=0.001)
    params = SamplingParams(max_tokens=300, ignore_eos=True, logprobs=True)

    async def read(pipeline, delay: float) -> tuple[list[Chunk], Complete]:
        chunks, complete = [], None
        async for event in pipeline.generate(GenerateInput("slow", prompt="Hi", params=params)):
            if isinstance(event, Chunk):
                chunks.append(event)
                await asyncio.sleep(delay)  # the reader is slower than the engine
            else:
                complete = event
        return chunks, complete

    with running(engine) as pipeline:
        chunks, complete = asyncio.run(read(pipeline, 0.05))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == [script[i % len(script)] for i in range(300)]
    assert len([lp for c in chunks for lp in c.logprobs]) == 300
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    assert len(chunks) < 100  # coalesced: 300 tokens would take 15 s at one per read
    assert complete.usage.completion_tokens == 300

"""n > 1 through the pipeline (services/pipeline/samples.py) over the FakeEngine: one
stream, every event tagged with its sample, one Complete per sample, sample 0 admitted
first and the others after its first token naming it to fork from, per-sample seeds,
cancellation of all."""

from __future__ import annotations

import asyncio

import pytest

from compute.core.errors import FieldError
from compute.core.sampling_params import SamplingParams
from compute.tokenizer.tokenizer import Tokenizer
from services.domain import Chunk, Complete, GenerateInput
from services.pipeline.pipeline import Pipeline, PipelineConfig
from tests.service.test_pipeline import running
from tests.support.fake_engine import FakeEngine, smollm2_tokenizer
from tests.support.waiting import wait_until

TEXT = " one two three four five six"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture
def engine(tok: Tokenizer) -> FakeEngine:
    return FakeEngine(tok, tok.encode(TEXT))


def request(n: int, **params: object) -> GenerateInput:
    params.setdefault("max_tokens", 6)
    return GenerateInput(request_id="r", prompt="Hi", params=SamplingParams(**params), n=n)


async def collect(pipeline: Pipeline, inp: GenerateInput) -> list[Chunk | Complete]:
    return [event async for event in pipeline.generate(inp)]


def test_each_sample_streams_its_own_text_and_one_complete(engine: FakeEngine) -> None:
    with running(engine) as pipeline:
        events = asyncio.run(collect(pipeline, request(3)))
    completes = [e for e in events if isinstance(e, Complete)]
    assert sorted(c.sample_index for c in completes) == [0, 1, 2]
    assert isinstance(events[-1], Complete)
    for i in range(3):
        text = "".join(e.text for e in events if isinstance(e, Chunk) and e.sample_index == i)
        assert text == TEXT
        last = next(e for e in events if isinstance(e, Complete) and e.sample_index == i)
        assert events.index(last) > max(
            k for k, e in enumerate(events) if isinstance(e, Chunk) and e.sample_index == i
        )
    assert len(engine.added) == 3 and pipeline.num_pending == 0


def test_the_other_samples_wait_for_the_first_token_and_get_their_own_seeds(
    engine: FakeEngine,
) -> None:
    seen: list[tuple[str, int | None, int]] = []  # (request id, seed, engine step at add)
    add = engine.add_request

    def recording(request_id, prompt, params, *args, **kwargs):
        seen.append((request_id, params.seed, engine.num_steps))
        add(request_id, prompt, params, *args, **kwargs)

    engine.add_request = recording
    engine.step_delay = 0.002
    with running(engine) as pipeline:
        asyncio.run(collect(pipeline, request(4, seed=100)))
    assert [seed for _, seed, _ in seen] == [100, 101, 102, 103]
    first_step = seen[0][2]
    assert all(step > first_step for _, _, step in seen[1:])  # after sample 0's first step
    first_id = seen[0][0]
    assert engine.forks[first_id] is None
    assert all(engine.forks[rid] == first_id for rid, _, _ in seen[1:])  # they fork sample 0


def test_cancelling_the_stream_cancels_every_sample(engine: FakeEngine) -> None:
    engine.step_delay = 0.005

    async def consume_some(pipeline: Pipeline) -> None:
        stream = pipeline.generate(request(3, max_tokens=2000))
        for _ in range(6):
            await anext(stream)
        await stream.aclose()

    with running(engine) as pipeline:
        asyncio.run(consume_some(pipeline))
        wait_until(lambda: sorted(engine.aborted) == sorted(engine.added))
        assert len(engine.added) == 3 and pipeline.num_pending == 0
        assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "inp, field",
    [
        (request(17), "n"),
        (request(0), "n"),
        (request(3, seed=2**63 - 2), "seed"),
    ],
)
def test_bad_n_names_the_field(engine: FakeEngine, inp: GenerateInput, field: str) -> None:
    with running(engine) as pipeline, pytest.raises(FieldError) as info:
        asyncio.run(collect(pipeline, inp))
    assert info.value.field == field
    assert engine.added == []


def test_max_n_is_a_pipeline_setting(engine: FakeEngine) -> None:
    with running(engine, max_n=2) as pipeline, pytest.raises(FieldError, match=r"n: must be"):
        asyncio.run(collect(pipeline, request(3)))
    with pytest.raises(ValueError, match="max_n"):
        PipelineConfig(max_n=0)


def test_an_invalid_sample_request_fails_before_anything_streams(engine: FakeEngine) -> None:
    with running(engine) as pipeline:
        with pytest.raises(FieldError, match="max_tokens"):
            asyncio.run(collect(pipeline, request(3, max_tokens=5000)))
        assert pipeline.num_pending == 0


def test_generate_batch_requests_with_n_carry_both_indexes(served) -> None:
    from services.gen.headrace.v1 import generation_pb2 as pb

    requests = [
        pb.GenerateRequest(prompt="Hi", n=2, stopping=pb.StoppingCriteria(max_tokens=3)),
        pb.GenerateRequest(prompt="Yo", stopping=pb.StoppingCriteria(max_tokens=3)),
    ]
    batch = pb.GenerateBatchRequest(requests=requests)
    responses = list(served.stub().GenerateBatch(batch, timeout=30))
    completes = sorted(
        (r.index, r.complete.sample_index) for r in responses if r.HasField("complete")
    )
    assert completes == [(0, 0), (0, 1), (1, 0)]
    chunks = {(r.index, r.chunk.sample_index) for r in responses if r.HasField("chunk")}
    assert chunks == {(0, 0), (0, 1), (1, 0)}

"""The three-stage pipeline around a FakeEngine: streaming, cancellation, errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from compute.core.errors import FieldError
from compute.core.sampling_params import SamplingParams
from compute.tokenizer.tokenizer import Tokenizer
from services.domain import (
    ChatMessage,
    Chunk,
    Complete,
    EngineFault,
    GenerateInput,
    ResourceExhausted,
    Unavailable,
)
from services.pipeline.pipeline import Pipeline, PipelineConfig
from services.telemetry.metrics import Metrics
from tests.support.fake_engine import FakeEngine, smollm2_tokenizer
from tests.support.waiting import wait_until

if TYPE_CHECKING:  # imported lazily by the slow test: it pulls in torch and the model
    from compute.engine import Engine

SCRIPT_TEXT = "Héllo wörld! 日本語 🎉 ok. STOP here, then more text."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture
def engine(tok: Tokenizer) -> FakeEngine:
    return FakeEngine(tok, tok.encode(SCRIPT_TEXT))


@contextlib.contextmanager
def running(engine: FakeEngine, **config: int) -> Iterator[Pipeline]:
    pipeline = Pipeline(engine, PipelineConfig(**config), Metrics())
    pipeline.start()
    try:
        yield pipeline
    finally:
        pipeline.stop()


def request(rid: str = "r", prompt: str | None = "Hi", **params: object) -> GenerateInput:
    params.setdefault("max_tokens", 16)
    return GenerateInput(request_id=rid, prompt=prompt, params=SamplingParams(**params))


async def collect(pipeline: Pipeline, inp: GenerateInput) -> tuple[list[Chunk], Complete]:
    chunks: list[Chunk] = []
    completes: list[Complete] = []
    async for event in pipeline.generate(inp):
        assert not completes, "nothing may follow the Complete"
        (chunks if isinstance(event, Chunk) else completes).append(event)
    assert len(completes) == 1
    return chunks, completes[0]


def test_chunks_concatenate_to_full_text(engine: FakeEngine, tok: Tokenizer) -> None:
    n = len(engine.script)
    with running(engine) as pipeline:
        chunks, done = asyncio.run(collect(pipeline, request(max_tokens=n)))
    assert "".join(c.text for c in chunks) == SCRIPT_TEXT
    assert [t for c in chunks for t in c.token_ids] == engine.script
    assert not any("\ufffd" in c.text for c in chunks)
    assert done.finish_reason == "length" and done.matched_stop == ""
    assert done.usage.completion_tokens == n
    assert done.usage.prompt_tokens == len(tok.encode("Hi"))
    timing = done.timing
    assert 0 <= timing.queue_seconds <= timing.time_to_first_token_seconds <= timing.total_seconds


def test_eos_finishes_with_stop_and_is_not_streamed(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    engine = FakeEngine(tok, [*tok.encode("Bye now"), eos, *tok.encode("never")])
    with running(engine) as pipeline:
        chunks, done = asyncio.run(collect(pipeline, request(max_tokens=50)))
    assert "".join(c.text for c in chunks) == "Bye now"
    assert done.finish_reason == "stop" and done.matched_stop == ""
    assert chunks[-1].token_ids[-1] == eos


def test_stop_string_truncates_and_aborts_the_engine_sequence(engine: FakeEngine) -> None:
    with running(engine) as pipeline:
        chunks, done = asyncio.run(collect(pipeline, request(max_tokens=1000, stop=(" STOP",))))
        wait_until(lambda: len(engine.aborted) == 1)
    assert "".join(c.text for c in chunks) == SCRIPT_TEXT.split(" STOP")[0]
    assert done.finish_reason == "stop" and done.matched_stop == " STOP"
    assert done.usage.completion_tokens < 500
    assert engine.aborted == engine.added


def test_include_stop_str_in_output(engine: FakeEngine) -> None:
    params = dict(max_tokens=1000, stop=("STOP",), include_stop_str_in_output=True)
    with running(engine) as pipeline:
        chunks, done = asyncio.run(collect(pipeline, request(**params)))
    assert "".join(c.text for c in chunks) == SCRIPT_TEXT.split("STOP")[0] + "STOP"
    assert done.matched_stop == "STOP"


def test_stop_strings_wait_for_min_tokens(engine: FakeEngine, tok: Tokenizer) -> None:
    n = len(engine.script)
    past_stop = len(tok.encode(SCRIPT_TEXT.split(" here")[0])) + 1  # " STOP" is before it
    with running(engine) as pipeline:
        params = dict(max_tokens=n, stop=(" STOP", " more"), min_tokens=past_stop)
        chunks, done = asyncio.run(collect(pipeline, request(**params)))
    assert "".join(c.text for c in chunks) == SCRIPT_TEXT.split(" more")[0]
    assert done.finish_reason == "stop" and done.matched_stop == " more"


def test_aclose_mid_stream_aborts_in_the_engine(engine: FakeEngine) -> None:
    engine.step_delay = 0.005

    async def consume_two(pipeline: Pipeline) -> None:
        stream = pipeline.generate(request(max_tokens=2000))
        for _ in range(2):
            assert isinstance(await anext(stream), Chunk)
        await stream.aclose()

    with running(engine) as pipeline:
        asyncio.run(consume_two(pipeline))
        wait_until(lambda: engine.aborted == engine.added and not engine.has_unfinished())
        assert pipeline.num_pending == 0


def test_task_cancellation_aborts_in_the_engine(engine: FakeEngine) -> None:
    engine.step_delay = 0.005

    async def cancel_mid_stream(pipeline: Pipeline) -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in pipeline.generate(request(max_tokens=2000)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with running(engine) as pipeline:
        asyncio.run(cancel_mid_stream(pipeline))
        wait_until(lambda: engine.aborted == engine.added and not engine.has_unfinished())
        assert pipeline.num_pending == 0


def test_max_pending_rejects_at_once(engine: FakeEngine) -> None:
    engine.step_delay = 0.005

    async def overload(pipeline: Pipeline) -> None:
        streams = [pipeline.generate(request(f"r{i}", max_tokens=2000)) for i in range(2)]
        for stream in streams:
            await anext(stream)
        assert pipeline.num_pending == 2
        with pytest.raises(ResourceExhausted):
            await anext(pipeline.generate(request("r2")))
        for stream in streams:
            await stream.aclose()
        assert pipeline.num_pending == 0
        await collect(pipeline, request("r3"))  # room again

    with running(engine, max_pending=2) as pipeline:
        asyncio.run(overload(pipeline))
        rendered = pipeline._metrics.render().decode()
    assert 'headrace_requests_rejected_total{reason="resource_exhausted"} 1.0' in rendered


@pytest.mark.parametrize(
    ("inp", "field"),
    [
        (request(prompt=""), "prompt"),
        (GenerateInput("r", prompt="a", token_ids=(1, 2)), "prompt"),
        (GenerateInput("r"), "prompt"),
        (GenerateInput("r", token_ids=()), "token_ids"),
        (GenerateInput("r", token_ids=(5, 49152)), "token_ids"),
        (GenerateInput("r", chat=(ChatMessage("wizard", "hi"),)), "chat.messages[0].role"),
        (GenerateInput("r", chat=()), "chat"),
        (request(prompt="Hi", max_tokens=2048), "max_tokens"),
        (GenerateInput("r", token_ids=(5,) * 2048), "token_ids"),
        (request(stop_token_ids=(49152,)), "stop_token_ids"),
    ],
)
def test_invalid_input_is_rejected_before_the_engine(
    engine: FakeEngine, inp: GenerateInput, field: str
) -> None:
    with running(engine) as pipeline:
        with pytest.raises(FieldError) as err:
            asyncio.run(collect(pipeline, inp))
        assert pipeline.num_pending == 0
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert engine.added == []


def test_engine_value_error_becomes_invalid_argument(engine: FakeEngine, tok: Tokenizer) -> None:
    engine.refuse_token = tok.encode("Hi")[0]
    with running(engine) as pipeline:
        with pytest.raises(FieldError) as err:
            asyncio.run(collect(pipeline, request()))
        chunks, _ = asyncio.run(collect(pipeline, request(prompt="Hello")))
    assert err.value.field == "prompt"
    assert chunks


def test_engine_fault_fails_only_its_requests(engine: FakeEngine, tok: Tokenizer) -> None:
    engine.poison_token = tok.encode(" poison")[0]

    async def scenario(pipeline: Pipeline) -> None:
        with pytest.raises(EngineFault):
            await collect(pipeline, request("bad", prompt="a poison pill"))
        chunks, done = await collect(pipeline, request("good", max_tokens=5))
        assert done.finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 5

    with running(engine) as pipeline:
        asyncio.run(scenario(pipeline))
        assert pipeline.num_pending == 0
    assert len(engine.aborted) == 1 and engine.aborted[0].startswith("bad")


def test_many_concurrent_streams_each_get_their_text(engine: FakeEngine) -> None:
    n = len(engine.script)
    engine.max_num_seqs = 8  # some wait in the engine while others run

    async def many(pipeline: Pipeline) -> list[str]:
        results = await asyncio.gather(
            *(collect(pipeline, request(f"r{i}", max_tokens=n)) for i in range(32))
        )
        return ["".join(c.text for c in chunks) for chunks, _ in results]

    for workers in (1, 3):
        with running(engine, output_workers=workers) as pipeline:
            assert asyncio.run(many(pipeline)) == [SCRIPT_TEXT] * 32
            assert 0.0 <= pipeline.step_loop_idle_fraction() <= 1.0
            assert pipeline.num_pending == 0


def test_logprobs_carry_token_strings(engine: FakeEngine, tok: Tokenizer) -> None:
    with running(engine) as pipeline:
        chunks, _ = asyncio.run(collect(pipeline, request(max_tokens=4, top_logprobs=2)))
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
        assert list(chunk.tokens) == [tok.decode([t]) for t in chunk.token_ids]
        assert all(len(lp.top) == 2 for lp in chunk.logprobs)
        for lp, texts in zip(chunk.logprobs, chunk.top_tokens, strict=True):
            assert list(texts) == [tok.decode([t]) for t, _ in lp.top]


def test_chat_and_token_id_prompts(engine: FakeEngine, tok: Tokenizer) -> None:
    chat = GenerateInput(
        "c", chat=(ChatMessage("user", "hi"),), params=SamplingParams(max_tokens=3)
    )
    ids = GenerateInput("t", token_ids=(1, 2, 3), params=SamplingParams(max_tokens=3))
    with running(engine) as pipeline:
        _, done_chat = asyncio.run(collect(pipeline, chat))
        _, done_ids = asyncio.run(collect(pipeline, ids))
    expected = len(tok.encode_chat([{"role": "user", "content": "hi"}]))
    assert done_chat.usage.prompt_tokens == expected
    assert done_ids.usage.prompt_tokens == 3


def test_tokenize_model_info_and_stats(engine: FakeEngine, tok: Tokenizer) -> None:
    with running(engine) as pipeline:
        ids, strs = asyncio.run(pipeline.tokenize("Hello world", None))
        chat_ids, _ = asyncio.run(pipeline.tokenize(None, (ChatMessage("user", "hi"),)))
        with pytest.raises(FieldError):
            asyncio.run(pipeline.tokenize(None, (ChatMessage("wizard", "hi"),)))
        info = pipeline.model_info()
        asyncio.run(collect(pipeline, request(max_tokens=3)))
        wait_until(lambda: pipeline.engine_stats().generation_tokens == 3)
    assert ids == tok.encode("Hello world") and strs == ["Hello", "Ġworld"]
    assert chat_ids == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert info.vocab_size == 49152 and info.max_model_len == 2048
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.kv_cache_capacity_tokens == engine.num_blocks * engine.block_size
    assert info.kv_cache_dtype == "float32"  # the engine's cache, not the flag's "auto"


def test_stop_fails_streams_in_flight_and_refuses_new_ones(engine: FakeEngine) -> None:
    engine.step_delay = 0.005
    pipeline = Pipeline(engine)
    pipeline.start()

    async def scenario() -> None:
        stream = pipeline.generate(request(max_tokens=2000))
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, pipeline.stop)
        with pytest.raises(Unavailable):
            async for _ in stream:
                pass
        with pytest.raises(Unavailable):
            await anext(pipeline.generate(request("late")))

    asyncio.run(scenario())
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def real_engine() -> Engine:
    from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from compute.engine import Engine

    config = EngineConfig(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_model_len=512),
        device=DeviceConfig(device="cpu", num_threads=1),
    )
    return Engine(config)


@pytest.mark.slow
def test_real_engine_streams_what_offline_generate_returns(real_engine: Engine) -> None:
    chat = (ChatMessage("user", "Say hello in French, with an emoji."),)
    params = SamplingParams(temperature=0, max_tokens=12)
    ids = real_engine.tokenizer.encode_chat([{"role": "user", "content": chat[0].content}])
    offline = real_engine.generate([ids], params)[0]  # before the step loop owns the engine
    pipeline = Pipeline(real_engine)
    pipeline.start()
    try:
        inp = GenerateInput("real", chat=chat, params=params)
        chunks, done = asyncio.run(collect(pipeline, inp))
        stopped = GenerateInput(
            "stop", chat=chat, params=replace(params, stop=(offline.text[2:5],))
        )
        _, stop_done = asyncio.run(collect(pipeline, stopped))
        wait_until(lambda: pipeline.engine_stats().num_running == 0)
    finally:
        pipeline.stop()
    assert [t for c in chunks for t in c.token_ids] == offline.token_ids
    assert "".join(c.text for c in chunks) == offline.text
    assert done.usage.prompt_tokens == len(ids)
    assert stop_done.finish_reason == "stop" and stop_done.matched_stop == offline.text[2:5]
    assert real_engine.stats().kv_usage == 0.0

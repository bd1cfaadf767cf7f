"""Speculative decoding behind the three-stage pipeline: a stop string completed inside a
step's accepted run ends the stream exactly where it ends without speculation."""

from __future__ import annotations

import asyncio

import pytest

from compute.core.config import SpeculativeConfig
from compute.core.sampling_params import SamplingParams
from services.domain import GenerateInput
from services.pipeline.pipeline import Pipeline
from tests.engine.test_speculative_engine import PARAGRAPH, make_engine
from tests.service.test_pipeline import collect
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def stream(spec: SpeculativeConfig, prompt: list[int], params: SamplingParams):
    engine = make_engine(spec)
    pipeline = Pipeline(engine)
    pipeline.start()
    try:
        chunks, done = asyncio.run(
            collect(pipeline, GenerateInput("s", token_ids=tuple(prompt), params=params))
        )
        wait_until(lambda: pipeline.engine_stats().num_running == 0, timeout=60)
    finally:
        pipeline.stop()
    assert engine.stats().kv_usage == 0.0
    return chunks, done, engine


def test_stop_strings_inside_an_accepted_run_end_it_there() -> None:
    engine = make_engine(SpeculativeConfig())
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": f"Repeat this paragraph exactly:\n{PARAGRAPH}"}]
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    text = engine.generate([prompt], greedy)[0].text
    # Stop strings ending at several places of the copied text: most end mid-step.
    for stop in (text[5:9], text[30:33], text[61:66]):
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,))
        want_chunks, want, _ = stream(SpeculativeConfig(), prompt, params)
        spec = SpeculativeConfig(method="ngram", num_tokens=4)
        got_chunks, got, spec_engine = stream(spec, prompt, params)
        assert spec_engine.scheduler.drafts.num_accepted_tokens > 0
        # Chunks of one step may be merged on delivery: the tokens are the same.
        assert [t for c in got_chunks for t in c.token_ids] == [
            t for c in want_chunks for t in c.token_ids
        ]
        assert "".join(c.text for c in got_chunks) == text.split(stop)[0]
        assert (got.finish_reason, got.matched_stop) == ("stop", stop)
        assert got.usage.completion_tokens == want.usage.completion_tokens

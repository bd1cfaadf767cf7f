"""Asynchronous output on the CPU: the engine launches step N+1 before it reads step N's
sampled ids (compute/engine.py), and every request still gets exactly the tokens,
logprobs and finish reasons of synchronous output.

The one-step-ahead bookkeeping itself is checked against the scheduler's invariants in
tests/core/test_scheduler_properties.py (AsyncDriver); here the real runner feeds the pending
ids from its sampled tensors, on the embedded model (whose greedy tokens depend on every
cached K/V value). Only the pinned-memory copy and its CUDA event are GPU-only
(tests/engine/test_engine_gpu.py).
"""

from __future__ import annotations

import pytest

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.messages import FinishReason
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from services.gen.headrace.v1 import generation_pb2 as pb
from tests.conftest import running_server
from tests.engine.test_engine import prompts, shared_model

pytestmark = pytest.mark.slow


def make_engine(async_output: bool, num_blocks: int = 256, **scheduler: object) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            scheduler=SchedulerConfig(**scheduler),
            device=DeviceConfig(device="cpu", async_output=async_output),
        ),
        loaded=shared_model(),
    )


def mixed_params(stop_token: int | None = None) -> list[SamplingParams]:
    """Greedy, seeded sampling, EOS honoured, a stop token, penalties, logprobs."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=40),  # may end on EOS
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            stop_token_ids=() if stop_token is None else (stop_token,),
        ),
        SamplingParams(temperature=0.7, seed=5, max_tokens=18, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True,
                       top_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),  # aborted
    ]  # fmt: skip


ABORTED, ABORT_AT_STEP = "r6", 9


def run(engine: Engine, params: list[SamplingParams]) -> dict[str, tuple]:
    """Drive the engine step by step (aborting r6 mid-way), like the step loop does."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    reasons: dict[str, FinishReason] = {}
    for i, (prompt, p) in enumerate(zip(prompts(len(params), seed=2), params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step == ABORT_AT_STEP:
            engine.abort(ABORTED)
        for out in engine.step():
            assert out.request_id not in reasons, "an output after the request finished"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
            assert out.num_output_tokens == len(tokens[out.request_id])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not engine.has_unfinished() and engine.take_failed() == []
    assert engine.stats().kv_usage == 0.0
    return {rid: (tokens[rid], logprobs[rid], reasons.get(rid)) for rid in tokens}


@pytest.fixture(scope="module")
def stop_token() -> int:
    """A token greedy request r3 emits mid-way, so that it stops on it."""
    engine = make_engine(async_output=False)
    prompt = prompts(7, seed=2)[3]
    [out] = engine.generate([prompt], mixed_params()[3])
    return out.token_ids[10]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 48])  # whole prompts, chunks
def test_async_output_gives_the_tokens_of_synchronous_output(stop_token, max_num_batched_tokens):
    params = mixed_params(stop_token)
    sync = run(make_engine(False, max_num_batched_tokens=max_num_batched_tokens), params)
    engine = make_engine(True, max_num_batched_tokens=max_num_batched_tokens)
    assert engine.async_output
    got = run(engine, params)
    assert len(got[ABORTED][0]) == len(sync[ABORTED][0]) - 1  # it was decoding
    assert_same_outputs(got, sync)
    assert sync["r3"][2] is FinishReason.STOP and sync["r3"][0][-1] == stop_token
    assert all(lp is not None for lp in got["r5"][1])


def assert_same_outputs(got: dict[str, tuple], sync: dict[str, tuple], exact=True) -> None:
    """Identical, but for the request aborted at a fixed step: its outputs come one step
    later, so it may have streamed one token fewer by then (a prefix of the same tokens).
    ``exact=False``: logprobs to 1e-4 (a prompt recomputed after a preemption may be
    chunked differently in the two runs, which moves fp32 sums, never the tokens)."""
    nothing: tuple = ([], [], None)
    aborted, expected = got.pop(ABORTED, nothing), sync.pop(ABORTED, nothing)
    if exact:
        assert got == sync
    else:
        assert {r: (t, f) for r, (t, _, f) in got.items()} == {
            r: (t, f) for r, (t, _, f) in sync.items()
        }
        for rid, (_, logprobs, _) in got.items():
            for mine, theirs in zip(logprobs, sync[rid][1], strict=True):
                if theirs is not None:
                    assert mine.token_id == theirs.token_id
                    assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert aborted[2] is None and expected[2] is None  # no finish reason: aborted
    assert len(expected[0]) - len(aborted[0]) in (0, 1)
    assert aborted[0] == expected[0][: len(aborted[0])]


def test_preemption_with_tokens_in_flight_keeps_outputs(stop_token) -> None:
    # 7 requests in 20 blocks (320 slots): running sequences are preempted while their
    # last sampled token is still unread.
    params = mixed_params(stop_token)
    for mode in ("recompute", "swap"):
        sync = run(make_engine(False, num_blocks=20, preemption_mode=mode), params)
        engine = make_engine(True, num_blocks=20, preemption_mode=mode)
        assert_same_outputs(run(engine, params), sync, exact=False)
        assert engine.stats().num_preemptions > 0


def test_outputs_come_one_step_later() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = make_engine(True)
    engine.add_request("a", prompts(1)[0], greedy)
    assert engine.step() == []  # the prefill sampled token 1; it is still in flight
    per_step = [[len(o.new_token_ids) for o in engine.step()] for _ in range(3)]
    assert per_step == [[1], [1], [1]]  # tokens 1, 2, 3; no fourth step was launched
    assert not engine.has_unfinished()


def test_aborting_the_last_request_drains_the_step_in_flight() -> None:
    engine = make_engine(True)
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine._in_flight is None
    assert engine.stats().kv_usage == 0.0
    assert engine.step() == []


def test_async_output_through_the_server() -> None:
    engine = make_engine(True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    texts = ["The capital of France is", "Write a haiku about rain."]
    reference = make_engine(False).generate(texts, greedy)
    requests = [
        pb.GenerateRequest(
            prompt=t,
            sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
        )
        for t in texts
    ]
    ids: dict[int, list[int]] = {i: [] for i in range(len(texts))}
    with running_server(engine) as served:
        batch = pb.GenerateBatchRequest(requests=requests)
        for response in served.stub().GenerateBatch(batch, timeout=120):
            if response.HasField("chunk"):
                ids[response.index].extend(response.chunk.token_ids)
    assert [ids[i] for i in range(len(texts))] == [r.token_ids for r in reference]

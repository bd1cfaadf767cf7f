"""Fault isolation on the real engine: a fault injected into one request of a mixed batch
(its forward, its sampling, or an out-of-range sampled id) fails that request alone, and
every other request gets exactly the tokens of a run without it (greedy and seeded).

Tiny random weights (``dummy:tiny``) keep it fast; a small token budget makes steps mix
prefill chunks and decodes.
"""

from __future__ import annotations

import random

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.runner.fault_isolation import FAULT_MESSAGE
from compute.runner.step_result import BAD_TOKEN_MESSAGE
from compute.sampling.sampler import apply_top_k_top_p
from tests.support.fault_injection import FaultInjector

BAD = "bad"


def make_engine(async_output: bool = False) -> Engine:
    return Engine(
        EngineConfig(
            model="dummy:tiny",
            cache=CacheConfig(block_size=16, num_blocks=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
            device=DeviceConfig(device="cpu", async_output=async_output),
        )
    )


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests of varied prompt lengths, plus BAD (seeded too)."""
    rng = random.Random(7)
    out = {}
    for i in range(6):
        prompt = [rng.randrange(1, 512) for _ in range(rng.randrange(4, 60))]
        if i % 2:
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        else:
            params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True)
        out[f"r{i}"] = (prompt, params)
    bad_prompt = [rng.randrange(1, 512) for _ in range(30)]
    out[BAD] = (bad_prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True))
    return out


def run(engine: Engine, reqs) -> tuple[dict[str, list[int]], list[tuple[str, str]]]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in reqs}
    failed: list[tuple[str, str]] = []
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        failed.extend(engine.take_failed())
    assert not engine.has_unfinished()
    return tokens, failed


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    reqs = requests()
    del reqs[BAD]
    tokens, failed = run(make_engine(), reqs)
    assert not failed
    return tokens


@pytest.mark.parametrize(
    ("kind", "after_tokens", "message"),
    [
        ("raise_in_forward", 0, FAULT_MESSAGE),  # in its first prefill chunk
        ("raise_in_forward", 3, FAULT_MESSAGE),  # mid-decode
        ("raise_in_sampling", 0, FAULT_MESSAGE),
        ("raise_in_sampling", 4, FAULT_MESSAGE),
        ("bad_token_id", 0, BAD_TOKEN_MESSAGE),
        ("bad_token_id", 5, BAD_TOKEN_MESSAGE),
    ],
)
@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async"])
def test_a_fault_fails_only_its_request(
    baseline, kind: str, after_tokens: int, message: str, async_output: bool
):
    # With asynchronous output a bad id is found a step late, after the next step was
    # launched on it (clamped): the request still fails alone, with nothing more streamed.
    engine = make_engine(async_output)
    engine.runner.faults = FaultInjector(**{kind: {BAD}}, after_tokens=after_tokens)
    tokens, failed = run(engine, requests())
    assert failed == [(BAD, message)]
    assert len(tokens[BAD]) == after_tokens  # what it got before the fault, nothing after
    del tokens[BAD]
    assert tokens == baseline
    assert engine.scheduler.kv_manager.num_free_blocks == engine.num_blocks  # nothing leaked
    assert "Error" not in message and "Exception" not in message


@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async"])
def test_two_faulty_requests_are_both_found(baseline, async_output: bool) -> None:
    engine = make_engine(async_output)
    engine.runner.faults = FaultInjector(raise_in_forward={BAD, "r2"}, after_tokens=1)
    tokens, failed = run(engine, requests())
    assert sorted(rid for rid, _ in failed) == [BAD, "r2"]
    assert {rid: t for rid, t in tokens.items() if rid not in (BAD, "r2")} == {
        rid: t for rid, t in baseline.items() if rid != "r2"
    }


def test_injection_is_off_by_default() -> None:
    engine = make_engine()
    assert engine.runner.faults is None and engine.runner.sampler.faults is None


def test_top_p_zero_keeps_the_best_token() -> None:
    # A top_p that is 0 in float32 (the 1e-300) must not drop every token: the
    # draw would then return id == vocab, which fails the next step's embedding lookup.
    logits = torch.randn(3, 50)
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.0, 1e-30, 1.0]))
    assert torch.isfinite(kept[0]).sum() == 1 and kept[0].argmax() == logits[0].argmax()
    assert torch.isfinite(kept[1]).sum() == 1
    assert torch.isfinite(kept[2]).all()

"""The full engine on real tensors: preemption (recompute and swap), prefix caching,
seeded sampling and aborts, checked against runs that exercise none of them.

Uses the embedded SmolLM2 weights, loaded once: a real model's greedy tokens depend
on every cached K/V value (a random tiny model collapses to one repeated token, which
would hide a block copied to the wrong place).
"""

from __future__ import annotations

import random

import pytest

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders import LoadedModel, load_model

pytestmark = pytest.mark.slow
_weights: LoadedModel | None = None


def shared_model() -> LoadedModel:
    """The embedded model, loaded once; each engine gets its own dict of the tensors."""
    global _weights
    if _weights is None:
        _weights = load_model("default", progress=False)
    w = _weights
    return LoadedModel(w.config, dict(w.weights), w.tokenizer, w.source)


def make_engine(num_blocks: int = 256, **scheduler: object) -> Engine:
    prefix_caching = scheduler.pop("prefix_caching", True)
    return Engine(
        EngineConfig(
            cache=CacheConfig(
                block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
            ),
            scheduler=SchedulerConfig(**scheduler),
            device=DeviceConfig(device="cpu"),
        ),
        loaded=shared_model(),
    )


TEXTS = [
    "Explain how a bicycle gear system works, step by step, for a curious child.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system and one surprising fact about each.",
    "What are the main differences between a list and a tuple in Python? Give examples.",
    "Describe the water cycle, from evaporation over the ocean to rain in the mountains.",
    "Give me a recipe for a simple tomato soup, with quantities and cooking times.",
    "Why do leaves change colour in autumn? Answer in a friendly paragraph.",
    "Summarise the plot of a heist movie you invent, in five sentences.",
    "How does a hash table handle collisions? Compare chaining and open addressing.",
    "Translate into French: the library opens at nine and closes at six.",
    "Write a haiku about the sea, then explain its imagery.",
    "What should a beginner know before planting a vegetable garden?",
]
INTRO = "You are a careful assistant. Answer clearly and completely. "


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts of varied lengths (a seeded number of intro sentences)."""
    rng = random.Random(seed)
    tokenizer = shared_model().tokenizer
    chats = []
    for i in range(n):
        system = INTRO * rng.randrange(1, 5)
        text = TEXTS[(i + seed) % len(TEXTS)]
        chats.append([{"role": "system", "content": system}, {"role": "user", "content": text}])
    return [tokenizer.encode_chat(c) for c in chats]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt run by itself on a roomy cache: the reference tokens."""
    engine = make_engine(prefix_caching=False)
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts(8)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(mode: str, alone) -> None:
    # 8 requests of up to 130 tokens in 24 blocks (384 slots): most must be preempted.
    engine = make_engine(num_blocks=24, preemption_mode=mode, max_num_seqs=8)
    outs = engine.generate(prompts(8), GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert engine.stats().kv_usage == 0.0


def test_prefix_cache_computes_only_new_tokens_and_keeps_outputs(alone) -> None:
    tokenizer = shared_model().tokenizer
    shared = tokenizer.encode(INTRO * 10)[:100]  # 6 full blocks + 4 tokens
    assert len(shared) == 100
    first = shared + tokenizer.encode(" Tell me about rivers.")
    second = shared + tokenizer.encode(" Tell me about mountains and valleys.")
    cold = make_engine(prefix_caching=False)
    expected = [o.token_ids for o in cold.generate([first, second], GREEDY)]

    engine = make_engine()
    got_first = engine.generate([first], GREEDY)[0]
    before = engine.stats().prompt_tokens
    got_second = engine.generate([second], GREEDY)[0]
    computed = engine.stats().prompt_tokens - before
    assert got_second.num_cached_tokens == 96  # the 6 full blocks both prompts share
    assert computed == len(second) - 96
    assert engine.stats().prefix_cache_hit_tokens == 96
    assert [got_first.token_ids, got_second.token_ids] == expected


def test_seeded_request_is_batch_invariant() -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=30)
    target = prompts(1, seed=3)[0]
    alone = make_engine().generate([target], seeded)[0].token_ids
    others = prompts(11, seed=4)
    batch = others[:5] + [target] + others[5:]
    params = [SamplingParams(temperature=1.0, max_tokens=25)] * 5 + [seeded]
    params += [SamplingParams(temperature=0.7, seed=i, max_tokens=35) for i in range(6)]
    outs = make_engine().generate(batch, params)
    assert outs[5].token_ids == alone


def test_abort_mid_generation_frees_blocks() -> None:
    engine = make_engine()
    for i, p in enumerate(prompts(6)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_usage > 0
    for i in range(6):
        engine.abort(f"r{i}")
    assert not engine.has_unfinished()
    assert engine.stats().kv_usage == 0.0
    assert engine.step() == []


def test_logprobs_through_the_engine() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=True, top_logprobs=3)
    out = make_engine().generate(prompts(1), params)[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy picks the top token


def test_admission_rejects_what_can_never_fit() -> None:
    engine = make_engine(num_blocks=4)  # 64 slots in all
    with pytest.raises(ValueError, match="^max_tokens"):
        engine.add_request("big", [5] * 40, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="^prompt"):
        engine.add_request("oov", [10**9], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished()


def test_step_records_where_its_time_went() -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode(TEXTS[0])
    engine.add_request("t", prompt, GREEDY)
    engine.step()  # the whole prompt in one prefill step
    prefill = engine.last_step_timing
    assert (prefill.num_seqs, prefill.num_tokens) == (1, len(prompt))
    engine.step()
    decode = engine.last_step_timing
    assert (decode.num_seqs, decode.num_tokens) == (1, 1)
    for timing in (prefill, decode):
        assert min(timing.schedule_s, timing.forward_s, timing.sample_s) >= 0.0
        assert timing.forward_s > 0.0

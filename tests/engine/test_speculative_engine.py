"""Speculative decoding through the full engine on the embedded model (CPU): the same
greedy tokens as without it, alone and batched, with chunked prefill, prefix hits,
preemption, stops and max_tokens inside an accepted run, and logprobs per token."""

from __future__ import annotations

import pytest

from compute.core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from tests.engine.test_engine import prompts, shared_model

pytestmark = pytest.mark.slow

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, ngram_max=3, max_batch=32)
PARAGRAPH = (
    "The old mill stood by the river for two hundred years. Every spring the water rose, "
    "turned the great wheel faster, and the miller ground more flour than the village "
    "could eat; the rest went by cart to the market town, two days away."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n"
)


def make_engine(
    spec: SpeculativeConfig = NGRAM, num_blocks: int = 256, prefix: bool = True, **scheduler
) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(**scheduler),
            # One thread: on a shared, busy machine two spin-waiting threads crawl.
            device=DeviceConfig(device="cpu", num_threads=1),
            speculative=spec,
        ),
        loaded=shared_model(),
    )


def copy_prompts() -> list[list[int]]:
    """Prompts whose answers copy or lightly edit their input: drafts are accepted."""
    tokenizer = shared_model().tokenizer
    asks = [
        f"Repeat this paragraph exactly:\n{PARAGRAPH}",
        f"Rewrite this paragraph, replacing 'mill' with 'bakery':\n{PARAGRAPH}",
        f"Add a docstring to this function and return it:\n{CODE}",
        f"Rename the variable 'total' to 'acc' in this code:\n{CODE}",
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]


def mixed(n: int) -> list[list[int]]:
    copies, free = copy_prompts(), prompts(8)
    return [(copies if i % 2 else free)[i // 2 % (4 if i % 2 else 8)] for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain() -> dict[tuple[int, ...], list[int]]:
    """Without speculation, each prompt alone: the reference tokens."""
    engine = make_engine(SpeculativeConfig())
    return {tuple(p): engine.generate([p], GREEDY)[0].token_ids for p in mixed(12)}


def test_greedy_identical_alone_and_drafts_accepted(plain) -> None:
    engine = make_engine()
    for p in copy_prompts():
        assert engine.generate([p], GREEDY)[0].token_ids == plain[tuple(p)]
    sched = engine.scheduler
    # The copy prompts' answers are largely drafted (1-grams included: ~40% accepted).
    assert sched.drafts.num_accepted_tokens > max(32, 0.3 * sched.drafts.num_draft_tokens)
    for p in prompts(2):
        assert engine.generate([p], GREEDY)[0].token_ids == plain[tuple(p)]
    stats = engine.stats()
    assert stats.spec_draft_tokens == sched.drafts.num_draft_tokens
    assert stats.spec_emitted_tokens > stats.spec_accepted_tokens > 0
    assert stats.kv_usage == 0.0


@pytest.mark.parametrize("batch", [2, 7, 12])
def test_greedy_identical_batched(plain, batch) -> None:
    engine = make_engine()
    batch_prompts = mixed(batch)
    outs = engine.generate(batch_prompts, GREEDY)
    assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in batch_prompts]
    assert engine.scheduler.drafts.num_accepted_tokens > 0


def test_greedy_identical_batch_of_32_short_requests() -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(32)
    ]
    batch = mixed(32)
    want = [o.token_ids for o in make_engine(SpeculativeConfig()).generate(batch, params)]
    engine = make_engine(max_num_seqs=32)
    assert [o.token_ids for o in engine.generate(batch, params)] == want
    assert engine.scheduler.drafts.num_draft_tokens > 0


def test_no_drafts_above_max_batch(plain) -> None:
    engine = make_engine(SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, max_batch=3))
    batch = mixed(6)
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in batch]


def test_chunked_prefill_and_prefix_hits(plain) -> None:
    engine = make_engine(max_num_batched_tokens=24)
    batch = copy_prompts()[:2] + prompts(1)
    for _ in range(2):  # the second time mostly from the prefix cache
        outs = engine.generate(batch, GREEDY)
        assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in batch]
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert engine.scheduler.drafts.num_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(plain, mode) -> None:
    engine = make_engine(num_blocks=20, preemption_mode=mode, max_num_seqs=8)
    batch = mixed(8)
    outs = engine.generate(batch, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in batch]
    assert engine.stats().kv_usage == 0.0


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(plain) -> None:
    p = copy_prompts()[0]
    ref = plain[tuple(p)]
    engine = make_engine()
    for n in (1, 2, 3, 6, 11):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert engine.generate([p], params)[0].token_ids == ref[:n]
    for i in (3, 14):
        stop = ref[i]
        first = ref.index(stop)
        params = SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]
        )
        out = engine.generate([p], params)[0]
        assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    assert engine.scheduler.drafts.num_accepted_tokens > 0
    assert engine.stats().kv_usage == 0.0


def test_logprobs_one_per_emitted_token(plain) -> None:
    p = copy_prompts()[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    want = make_engine(SpeculativeConfig()).generate([p], params)[0]
    got = make_engine().generate([p], params)[0]
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(got.token_ids) == 30
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_sampling_is_reproducible_with_speculation() -> None:
    p = copy_prompts()[1]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=30)
    first = make_engine().generate([p], params)[0].token_ids
    second = make_engine().generate([p, *prompts(2)], [params] + [GREEDY] * 2)[0].token_ids
    assert first == second
    # One uniform per emitted token: the stream is the one drawn without speculation.
    assert first == make_engine(SpeculativeConfig()).generate([p], params)[0].token_ids


def test_async_output_is_refused_with_speculation() -> None:
    with pytest.raises(ValueError, match="^async_output"):
        Engine(
            EngineConfig(device=DeviceConfig(device="cpu", async_output=True), speculative=NGRAM),
            loaded=shared_model(),
        )


def test_greedy_identical_on_the_torch_path() -> None:
    """The torch attention path (``--cpu-kernels torch``) scores drafts as well."""

    def engine(spec: SpeculativeConfig) -> Engine:
        device = DeviceConfig(device="cpu", num_threads=1, cpu_kernels="torch")
        config = EngineConfig(cache=CacheConfig(num_blocks=64), device=device, speculative=spec)
        return Engine(config, loaded=shared_model())

    batch = copy_prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in engine(SpeculativeConfig()).generate(batch, params)]
    spec = engine(NGRAM)
    assert [o.token_ids for o in spec.generate(batch, params)] == want
    assert spec.scheduler.drafts.num_accepted_tokens > 0

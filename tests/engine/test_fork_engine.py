"""n > 1 forks on the real engine: samples added after their first sample's first token
(as services/pipeline/samples.py does) and naming it in ``fork_of`` share its prompt's
K/V. Greedy samples equal the single answer, seeded ones their solo runs with seed + i;
the prompt is computed once plus one token per extra sample, with prefix caching on or
off; blocks all come back after completion, aborts and preemption; a parent gone means a
normal admission. Also asynchronous output, speculative decoding, an int8 KV cache and
fault isolation with forks in the batch, and the copied block's rows read back from the
device's own caches (a CUDA variant, gpu-marked, with CUDA's defaults: asynchronous output).

The scheduler's bookkeeping itself (shared and copied blocks, fallbacks, no shared block
ever written) is in tests/core/test_fork_scheduler.py and the property tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compute.core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders import LoadedModel
from tests.engine.test_engine import prompts, shared_model
from tests.support.fault_injection import FaultInjector

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True)


def make_engine(
    prefix: bool = True,
    num_blocks: int = 256,
    loaded: LoadedModel | None = None,
    cache: dict | None = None,
    device: dict | None = None,
    speculative: SpeculativeConfig | None = None,
    **scheduler: object,
) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(
            block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix, **(cache or {})
        ),
        scheduler=SchedulerConfig(**scheduler),
        device=DeviceConfig(device="cpu", **(device or {})),
        speculative=speculative or SpeculativeConfig(),
    )
    return Engine(config, loaded=loaded or shared_model())


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i's parameters: seed + i, as the pipeline gives them."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


class Samples:
    """n samples of each prompt, driven like the pipeline: sample 0 first, the others
    (naming it in fork_of) once it has its first token."""

    def __init__(self, engine: Engine, n: int, fork: bool = True) -> None:
        self.engine, self.n, self.fork = engine, n, fork
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self._prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self._waiting: set[str] = set()  # first samples whose others are not added yet

    def add(self, name: str, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(f"{name}.0", prompt, params)
        self.tokens[f"{name}.0"] = []
        self._prompts[name] = (prompt, params)
        self._waiting.add(name)

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens[out.request_id].extend(out.new_token_ids)
            self.cached[out.request_id] = out.num_cached_tokens
        for name in sorted(self._waiting):
            if self.tokens[f"{name}.0"]:
                self._waiting.discard(name)
                self._add_others(name)
        for rid, _ in self.engine.take_failed():
            self.tokens[rid].append(-1)  # marks a failure

    def _add_others(self, name: str) -> None:
        prompt, params = self._prompts[name]
        for i in range(1, self.n):
            rid = f"{name}.{i}"
            fork_of = f"{name}.0" if self.fork else None
            self.engine.add_request(rid, prompt, sample_params(params, i), fork_of=fork_of)
            self.tokens[rid] = []

    def run(self) -> dict[str, list[int]]:
        for _ in range(1000):
            if not self.engine.has_unfinished() and not self._waiting:
                return self.tokens
            self.step()
        raise AssertionError("the samples did not finish")


def alone(prompt: list[int], params: SamplingParams, **engine: object) -> list[int]:
    return make_engine(prefix=False, **engine).generate([prompt], params)[0].token_ids


def assert_all_free(engine: Engine) -> None:
    kv = engine.scheduler.kv_manager
    assert kv.usage == 0 and kv.num_free_blocks == engine.num_blocks
    assert kv.host_allocator.num_free == kv.host_allocator.num_blocks


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    p = prompts(1, seed=5)[0]
    assert len(p) % 16 != 1  # a partial last block to copy
    return p


@pytest.fixture(scope="module")
def greedy_alone(prompt) -> list[int]:
    return alone(prompt, GREEDY)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_greedy_samples_equal_the_single_answer_and_the_prompt_is_computed_once(
    prefix, prompt, greedy_alone
) -> None:
    engine = make_engine(prefix)
    samples = Samples(engine, n=3)
    samples.add("q", prompt, GREEDY)
    tokens = samples.run()
    assert [tokens[f"q.{i}"] for i in range(3)] == [greedy_alone] * 3
    stats = engine.stats()
    assert stats.prompt_tokens == len(prompt) + 2  # once, plus one token per extra sample
    assert (stats.samples_forked, stats.samples_not_forked) == (2, 0)
    assert samples.cached == {"q.0": 0, "q.1": len(prompt) - 1, "q.2": len(prompt) - 1}
    assert_all_free(engine)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_seeded_samples_equal_their_solo_runs_with_seed_plus_index(prefix, prompt) -> None:
    engine = make_engine(prefix)
    samples = Samples(engine, n=3)
    samples.add("q", prompt, SEEDED)
    tokens = samples.run()
    solo = [alone(prompt, sample_params(SEEDED, i)) for i in range(3)]
    assert [tokens[f"q.{i}"] for i in range(3)] == solo
    assert len({tuple(t) for t in solo}) > 1
    assert engine.stats().samples_forked == 2
    assert_all_free(engine)


@pytest.mark.parametrize("victim", ["q.0", "q.1"], ids=["parent", "fork"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_aborting_a_sample_mid_stream_leaves_the_others_whole(
    victim, prefix, prompt, greedy_alone
) -> None:
    engine = make_engine(prefix)
    samples = Samples(engine, n=3)
    samples.add("q", prompt, GREEDY)
    while len(samples.tokens.get("q.2", [])) < 2:
        samples.step()
    engine.abort(victim)
    tokens = samples.run()
    assert tokens[victim] == greedy_alone[: len(tokens[victim])]
    for rid in {"q.0", "q.1", "q.2"} - {victim}:
        assert tokens[rid] == greedy_alone
    assert engine.stats().samples_forked == 2
    assert_all_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_samples_under_preemption_pressure_keep_their_tokens(mode, prefix) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=40)
    texts = prompts(2, seed=6)
    want = [alone(p, params) for p in texts]
    # 2 prompts of ~100 tokens and 3 samples each, growing by 40 tokens, in 18 blocks.
    engine = make_engine(prefix, num_blocks=18, preemption_mode=mode, max_num_seqs=8)
    samples = Samples(engine, n=3)
    for k, p in enumerate(texts):
        samples.add(f"q{k}", p, params)
    tokens = samples.run()
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.samples_forked > 0
    for k in range(2):
        assert [tokens[f"q{k}.{i}"] for i in range(3)] == [want[k]] * 3
    assert_all_free(engine)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_a_sample_whose_first_is_gone_is_admitted_as_any_request(prefix, prompt) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=1)  # sample 0 ends with its first token
    engine = make_engine(prefix)
    samples = Samples(engine, n=2)
    samples.add("q", prompt, params)
    tokens = samples.run()
    assert tokens["q.0"] == tokens["q.1"] == alone(prompt, params)
    stats = engine.stats()
    assert (stats.samples_forked, stats.samples_not_forked) == (0, 1)
    hit = (len(prompt) - 1) // 16 * 16 if prefix else 0  # the prefix cache's full blocks
    assert samples.cached["q.1"] == hit
    assert stats.prompt_tokens == 2 * len(prompt) - hit
    assert_all_free(engine)


def test_without_fork_of_the_samples_recompute(prompt, greedy_alone) -> None:
    """The baseline the forks save: samples naming no parent compute the whole prompt."""
    engine = make_engine(prefix=False)
    samples = Samples(engine, n=3, fork=False)
    samples.add("q", prompt, GREEDY)
    assert samples.run() == {f"q.{i}": greedy_alone for i in range(3)}
    assert engine.stats().prompt_tokens == 3 * len(prompt)


def test_forks_with_asynchronous_output(prompt, greedy_alone) -> None:
    engine = make_engine(device={"async_output": True})
    samples = Samples(engine, n=3)
    samples.add("q", prompt, GREEDY)
    assert samples.run() == {f"q.{i}": greedy_alone for i in range(3)}
    assert engine.stats().samples_forked == 2
    assert_all_free(engine)


def test_forks_with_speculative_decoding() -> None:
    """Drafts are scored past the fork's own blocks, and their rollback trims only them."""
    tokenizer = shared_model().tokenizer
    text = "Repeat after me: " + "the cat sat on the mat, " * 6 + "the cat"
    prompt = tokenizer.encode(text)
    params = dataclasses.replace(GREEDY, max_tokens=24)
    ngram = SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, ngram_max=3)
    engine = make_engine(prefix=False, speculative=ngram)
    samples = Samples(engine, n=3)
    samples.add("q", prompt, params)
    assert samples.run() == {f"q.{i}": alone(prompt, params) for i in range(3)}
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.samples_forked == 2
    assert_all_free(engine)


def test_forks_with_an_int8_kv_cache_copy_the_scales() -> None:
    from tests.engine.test_kv_cache_dtype import make_engine as int8_engine
    from tests.engine.test_kv_cache_dtype import prompts as int8_prompts

    prompt = int8_prompts(2)[1]
    want = int8_engine("int8", prefix_caching=False).generate([prompt], GREEDY)[0].token_ids
    engine = int8_engine("int8", prefix_caching=False)
    samples = Samples(engine, n=3)
    samples.add("q", prompt, GREEDY)
    assert samples.run() == {f"q.{i}": want for i in range(3)}
    assert engine.stats().samples_forked == 2


@pytest.mark.parametrize(
    ("target", "after_tokens"),
    [("q.1", 0), ("q.1", 3), ("q.0", 2)],
    ids=["fork-at-its-fork-step", "fork-mid-decode", "parent-after-the-forks"],
)
def test_a_fault_in_one_sample_fails_it_alone(target, after_tokens) -> None:
    def engine() -> Engine:
        return Engine(
            EngineConfig(
                model="dummy:tiny",
                cache=CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
                device=DeviceConfig(device="cpu"),
            )
        )

    prompt = [(7 * i) % 500 + 1 for i in range(40)]
    baseline = Samples(engine(), n=3)
    baseline.add("q", prompt, SEEDED)
    want = baseline.run()
    faulty = engine()
    faulty.runner.faults = FaultInjector(raise_in_forward={target}, after_tokens=after_tokens)
    samples = Samples(faulty, n=3)
    samples.add("q", prompt, SEEDED)
    tokens = samples.run()
    assert tokens[target] == want[target][:after_tokens] + [-1]
    assert {r: t for r, t in tokens.items() if r != target} == {
        r: t for r, t in want.items() if r != target
    }
    assert faulty.stats().samples_forked == 2
    assert_all_free(faulty)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.float16, marks=[pytest.mark.gpu, GPU])],
)
def test_the_fork_step_copies_the_partial_block_rows_in_every_layer(device, dtype) -> None:
    """On the device's own caches (asynchronous output where it is the default): the
    fork's block table starts with the parent's full blocks, and its copy of the partial
    one holds the parent's rows, keys and values, in every layer."""
    from compute.loaders.dummy import load_dummy

    loaded = load_dummy("smollm2-135m", dtype, device, seed=0)
    config = EngineConfig(
        model="dummy:smollm2-135m",
        cache=CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False),
        device=DeviceConfig(device=device, dtype=str(dtype).removeprefix("torch.")),
    )
    engine = Engine(config, loaded=loaded)
    prompt = [(37 * i) % 40000 + 4 for i in range(40)]  # 2 full blocks, 8 tokens after
    samples = Samples(engine, n=2)
    samples.add("q", prompt, GREEDY)
    while "q.1" not in samples.tokens:
        samples.step()
    samples.step()  # the step that admits the fork
    parent, fork = engine.scheduler.get("q.0"), engine.scheduler.get("q.1")
    assert engine.stats().samples_forked == 1
    assert fork.block_ids[:2] == parent.block_ids[:2]
    assert fork.block_ids[2] != parent.block_ids[2]
    if device == "cuda":
        torch.cuda.synchronize()
    for keys, values in engine.runner.kv_caches:
        for cache in (keys, values):
            # Rows of positions 32..38; 39, the last prompt token, the fork computes itself.
            assert torch.equal(cache[fork.block_ids[2], :7], cache[parent.block_ids[2], :7])
    samples.run()
    assert_all_free(engine)

"""--kv-cache-dtype: the flag and its resolution, KV capacity, and the engine's invariants
(batch invariance, chunked prefill, prefix hits, swap and recompute preemption) within
each 16- and 8-bit cache dtype, on the embedded model.

The kernels' agreement with the fp32 cache on the same inputs is in
tests/kernels/test_cpu_kernels.py, the fused decoder call in
tests/kernels/test_cpu_decoder.py, and the agreement with HF (teacher-forced top-1,
perplexity) in tests/engine/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders import LoadedModel, load_model
from compute.runner.model_runner import blocks_for_memory, kv_cache_dtype
from services.cli import cli, cli_flags
from tests.engine.test_engine import INTRO, TEXTS

_weights: LoadedModel | None = None


def shared_model() -> LoadedModel:
    """The embedded model in its GGUF blocks (--weights quantized: the fast CPU path),
    loaded once; each engine gets its own dict of the tensors."""
    global _weights
    if _weights is None:
        _weights = load_model("default", progress=False, quantized=True)
    w = _weights
    return LoadedModel(w.config, dict(w.weights), w.tokenizer, w.source)


def prompts(n: int) -> list[list[int]]:
    """n chat prompts of varied lengths (60 to 130 tokens)."""
    tokenizer = shared_model().tokenizer
    chats = [
        [
            {"role": "system", "content": INTRO * (1 + i % 4)},
            {"role": "user", "content": TEXTS[i % len(TEXTS)]},
        ]
        for i in range(n)
    ]
    return [tokenizer.encode_chat(c) for c in chats]


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> cli_flags.Configs:
    return cli_flags.build_configs(cli.build_parser(environ or {}).parse_args(argv))


def test_the_flag_its_env_twin_and_its_help(capsys) -> None:
    assert _parse(["serve"]).engine.cache.kv_cache_dtype == "auto"
    assert _parse(["serve", "--kv-cache-dtype", "float16"]).engine.cache.kv_cache_dtype == "float16"
    environ = {"HEADRACE_KV_CACHE_DTYPE": "bfloat16"}
    assert _parse(["serve"], environ).engine.cache.kv_cache_dtype == "bfloat16"
    flagged = _parse(["serve", "--kv-cache-dtype", "float32"], environ)
    assert flagged.engine.cache.kv_cache_dtype == "float32"
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser({"HEADRACE_KV_CACHE_DTYPE": "int4"})
    assert exit_info.value.code == 2
    assert "HEADRACE_KV_CACHE_DTYPE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-dtype" in text and "HEADRACE_KV_CACHE_DTYPE; default: auto]" in text


def test_the_config_validates_once_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of"):
        CacheConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    ("name", "device", "dtype", "weights", "want"),
    [
        ("auto", CPU, torch.float32, "quantized", torch.float32),  # exact stays exact
        ("auto", CPU, torch.float32, "dense", torch.float32),
        ("auto", CPU, torch.float32, "quantized-int8", torch.float16),  # llama.cpp's numerics
        ("auto", CUDA, torch.bfloat16, "dense", torch.bfloat16),  # the model dtype on CUDA
        ("bfloat16", CPU, torch.float32, "quantized-int8", torch.bfloat16),
        ("float16", CPU, torch.float32, "quantized", torch.float16),
        ("float32", CPU, torch.float32, "quantized-int8", torch.float32),
        ("float16", CUDA, torch.float16, "dense", torch.float16),
        ("int8", CPU, torch.float32, "quantized", torch.int8),
    ],
)
def test_auto_resolution(name, device, dtype, weights, want) -> None:
    assert kv_cache_dtype(CacheConfig(kv_cache_dtype=name), device, dtype, weights) == want


@pytest.mark.parametrize(("name", "dtype"), [("float16", torch.bfloat16), ("int8", torch.float16)])
def test_cuda_refuses_a_cache_dtype_its_kernels_cannot_read(name, dtype) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: the CUDA attention kernels"):
        kv_cache_dtype(CacheConfig(kv_cache_dtype=name), CUDA, dtype, "dense")


def test_int8_refuses_a_head_dim_its_rows_cannot_carry_a_scale_in() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: an int8 KV cache needs a head_dim .* 40"):
        kv_cache_dtype(CacheConfig(kv_cache_dtype="int8"), CPU, torch.float32, "quantized", 40)
    assert kv_cache_dtype(CacheConfig(kv_cache_dtype="int8"), CPU, torch.float32, "dense", 80)


def test_blocks_from_a_memory_budget_follow_the_dtype_bytes() -> None:
    cfg, cache = shared_model().config, CacheConfig()
    fp32 = blocks_for_memory(cfg, cache, 1.0, torch.float32)
    assert blocks_for_memory(cfg, cache, 1.0, torch.float16) == 2 * fp32
    assert blocks_for_memory(cfg, cache, 1.0, torch.bfloat16) == 2 * fp32
    # int8: 64 codes per token and head (the scale rides in them), against 256 bytes
    assert blocks_for_memory(cfg, cache, 1.0, torch.int8) // 4 == fp32  # floors of 4x


def make_engine(kv: str, num_blocks: int | None = 256, **scheduler) -> Engine:
    prefix_caching = scheduler.pop("prefix_caching", True)
    memory_gib = scheduler.pop("memory_gib", None)
    cache = CacheConfig(
        block_size=16,
        num_blocks=num_blocks,
        memory_gib=memory_gib,
        enable_prefix_caching=prefix_caching,
        kv_cache_dtype=kv,
    )
    return Engine(
        EngineConfig(
            cache=cache,
            scheduler=SchedulerConfig(**scheduler),
            device=DeviceConfig(device="cpu"),
        ),
        loaded=shared_model(),
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KV = ["float16", "bfloat16", "int8"]


@pytest.fixture(scope="module", params=KV)
def kv(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def alone(kv) -> list[list[int]]:
    """Each prompt by itself on a roomy cache of this dtype: the reference tokens."""
    engine = make_engine(kv, prefix_caching=False)
    caches = engine.runner.kv_caches
    assert all(t.dtype == getattr(torch, kv) for pair in caches for t in pair)
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts(6)]


@pytest.mark.slow
def test_memory_line_and_capacity_follow_the_dtype(kv) -> None:
    ratio = 4 if kv == "int8" else 2  # bytes of a token's head: fp32 / this dtype
    small = make_engine(kv, num_blocks=None, memory_gib=0.05)
    full = make_engine("float32", num_blocks=None, memory_gib=0.05)
    assert abs(small.num_blocks - ratio * full.num_blocks) <= ratio
    budget = int(0.05 * 1024**3)
    for engine in (small, full):  # the budget, less what a whole block does not fill
        block = engine.memory["kv_cache_bytes"]["cpu"] / engine.num_blocks
        assert budget - block < engine.memory["kv_cache_bytes"]["cpu"] <= budget
    same = make_engine(kv, num_blocks=64)
    ref = make_engine("float32", num_blocks=64)
    got = ref.memory["kv_cache_bytes"]["cpu"] / same.memory["kv_cache_bytes"]["cpu"]
    assert got == pytest.approx(ratio)


@pytest.mark.slow
def test_a_batch_gives_the_tokens_of_each_prompt_alone(kv, alone) -> None:
    outs = make_engine(kv).generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == alone


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_tokens(kv, alone) -> None:
    engine = make_engine(kv, max_num_seqs=4, max_num_batched_tokens=7)
    outs = engine.generate(prompts(6)[-2:], GREEDY)
    assert [o.token_ids for o in outs] == alone[-2:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(kv, alone, mode) -> None:
    engine = make_engine(kv, num_blocks=20, preemption_mode=mode, max_num_seqs=6)
    outs = engine.generate(prompts(6), GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == alone


@pytest.mark.slow
def test_prefix_hits_keep_outputs(kv) -> None:
    tokenizer = shared_model().tokenizer
    shared = tokenizer.encode(INTRO * 10)[:100]
    first = shared + tokenizer.encode(" Tell me about rivers.")
    second = shared + tokenizer.encode(" Tell me about mountains and valleys.")
    cold = make_engine(kv, prefix_caching=False)
    expected = [o.token_ids for o in cold.generate([first, second], GREEDY)]
    engine = make_engine(kv)
    got_first = engine.generate([first], GREEDY)[0]
    got_second = engine.generate([second], GREEDY)[0]
    assert got_second.num_cached_tokens == 96
    assert [got_first.token_ids, got_second.token_ids] == expected

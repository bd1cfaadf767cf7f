"""Parity of the engine with HF transformers on the embedded SmolLM2 GGUF (fp32, CPU).

The three checks that catch almost every engine bug: token-for-token greedy
parity with the reference, batch invariance, and chunked-vs-whole prefill. Each runs
for the three ways the CPU engine can hold the weights (--weights):

- dense: dequantized at load, torch ops (the reference path);
- quantized: the GGUF blocks on the CPU kernels, fp32 math: the weights are bit-identical,
  so parity must be exactly as strict;
- quantized-int8: int8 activations (llama.cpp's numerics): greedy decoding drifts from
  HF after a few tokens, so its parity is the teacher-forced agreement and perplexity
  delta on a fixed text; batch invariance and chunked prefill stay exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders.default_model import default_model_path
from compute.models.decoder import DecoderModel
from kernels import reference
from kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'good morning' to Spanish."},
    ],
]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


# --weights -> (teacher-forced top-1 agreement with HF at least, perplexity delta at most).
MODES = {
    "dense": (1.0, 1e-4),
    "quantized": (1.0, 1e-4),
    "quantized-int8": (0.95, 0.01),  # measured: 0.995 and +0.32% on this text (b9ca7cb)
}
EXACT_MODES = ("dense", "quantized")
# Teacher-forced text: prose, code and digits, ~500 tokens.
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the "
    "one hundred and twelve steps as his father had before him. From the gallery he could "
    "see the whole bay: the fishing boats returning with their lamps lit, the gulls settling "
    "on the breakwater, and beyond them the dark line where the sea met the sky. "
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\nprint(mean([3, 5, 8, 13, 21]))\n"
    "In 1969, the Apollo 11 mission landed two astronauts on the Moon. The lunar module, "
    "Eagle, touched down in the Sea of Tranquility on July 20, and Neil Armstrong stepped "
    "onto the surface about six hours later. Photosynthesis converts light energy into "
    "chemical energy: plants take in carbon dioxide and water and, using sunlight, produce "
    "glucose and oxygen. The mitochondria then release that energy through respiration. "
) * 2


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(mode) -> Engine:
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024),
        device=DeviceConfig(
            device="cpu", cpu_kernels="torch" if mode == "dense" else "native", weights=mode
        ),
    )
    return Engine(cfg)


@pytest.fixture
def exact(mode):
    if mode not in EXACT_MODES:
        pytest.skip(f"{mode} is approximate: see test_teacher_forced_agreement_with_hf")


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(c) for c in CHATS]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> list[list[int]]:
    # A bare argmax loop over HF's KV cache: generate()'s logits processors (e.g.
    # min_new_tokens masking EOS) would make it a different reference than ignore_eos.
    model, _ = hf
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(NEW_TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            outs.append(tokens)
    return outs


@pytest.fixture(scope="module")
def one_at_a_time(engine: Engine, prompts) -> list[list[int]]:
    return [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]


def test_greedy_matches_hf_token_for_token(exact, hf_greedy, one_at_a_time, prompts):
    assert len(prompts) >= 8
    for ours, ref in zip(one_at_a_time, hf_greedy, strict=True):
        assert ours == ref


def test_last_position_logits_match_hf(exact, hf, engine, prompts):
    model, _ = hf
    ours = _StandaloneModel(engine.runner.model)
    for ids in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1]
        got = ours.prefill_logits(ids, chunk=len(ids))
        assert (got - ref).abs().max().item() < 1e-3


def test_teacher_forced_agreement_with_hf(hf, engine, mode):
    model, _ = hf
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 400
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    got = _StandaloneModel(engine.runner.model, blocks=-(-len(ids) // 16)).all_logits(ids)
    target = torch.tensor(ids[1:])
    agreement = (got[:-1].argmax(-1) == ref[:-1].argmax(-1)).float().mean().item()
    ppl_ours = math.exp(torch.nn.functional.cross_entropy(got[:-1], target).item())
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(ref[:-1], target).item())
    min_agreement, max_ppl_delta = MODES[mode]
    assert agreement >= min_agreement
    assert abs(ppl_ours / ppl_ref - 1) <= max_ppl_delta


# (--weights, --kv-cache-dtype) -> (teacher-forced top-1 agreement with HF at least,
# perplexity delta at most), on TEXT: K/V rounded to the cache dtype when written.
KV_MODES = {  # measured at the commit that added them: agreement, perplexity delta
    ("dense", "float16"): (0.99, 0.002),  # 1.000, -0.003%
    ("quantized", "float16"): (0.99, 0.002),  # 1.000, +0.001%
    ("quantized", "bfloat16"): (0.98, 0.005),  # 1.000, -0.052%
    ("quantized", "int8"): (0.98, 0.005),  # 0.993, -0.18% (scale in the codes' parities)
    ("quantized-int8", "float16"): (0.95, 0.01),  # auto for quantized-int8: 0.988, +0.57%
    ("quantized-int8", "bfloat16"): (0.95, 0.012),  # 0.988, +0.64%
    ("quantized-int8", "int8"): (0.95, 0.01),  # 0.981, +0.47% (the same)
}


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_kv_cache_dtype_agreement_with_hf(hf, engine, mode, kv_dtype):
    if (mode, kv_dtype) not in KV_MODES:
        pytest.skip(f"{mode} with a {kv_dtype} cache: not a measured combination")
    model, _ = hf
    ids = engine.tokenizer.encode(TEXT)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours = _StandaloneModel(engine.runner.model, blocks=-(-len(ids) // 16), kv_dtype=kv_dtype)
    got = ours.all_logits(ids)
    target = torch.tensor(ids[1:])
    agreement = (got[:-1].argmax(-1) == ref[:-1].argmax(-1)).float().mean().item()
    ppl_ours = math.exp(torch.nn.functional.cross_entropy(got[:-1], target).item())
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(ref[:-1], target).item())
    print(f"kv {mode} {kv_dtype}: agreement {agreement:.4f}, ppl {ppl_ours / ppl_ref - 1:+.4%}")
    min_agreement, max_ppl_delta = KV_MODES[mode, kv_dtype]
    assert agreement >= min_agreement
    assert abs(ppl_ours / ppl_ref - 1) <= max_ppl_delta


def test_batch_gives_same_tokens_as_one_at_a_time(engine, prompts, one_at_a_time):
    together = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert together == one_at_a_time


def test_mixed_batch_of_32_equals_one_at_a_time(engine, prompts, one_at_a_time):
    # 32 requests with staggered lengths so prefills and decodes share steps.
    reqs, params = [], []
    for i in range(32):
        reqs.append(prompts[i % len(prompts)])
        n = 8 + (i * 7) % (NEW_TOKENS - 7)
        params.append(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outs = engine.generate(reqs, params)
    for i, out in enumerate(outs):
        assert out.token_ids == one_at_a_time[i % len(prompts)][: params[i].max_tokens]


def test_chunked_prefill_equals_whole_prefill(engine, prompts):
    model = _StandaloneModel(engine.runner.model)
    for ids in prompts[:4] + prompts[-2:]:
        whole = model.prefill_logits(ids, chunk=len(ids))
        whole_cache = model.cache_rows(len(ids))
        chunked = model.prefill_logits(ids, chunk=7)
        chunked_cache = model.cache_rows(len(ids))
        torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
        for (ka, va), (kb, vb) in zip(whole_cache, chunked_cache, strict=True):
            torch.testing.assert_close(ka, kb, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(va, vb, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_engine_matches(engine, prompts, one_at_a_time):
    # A 7-token budget forces every prompt through several prefill chunks.
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7),
        device=engine.config.device,
    )
    small = Engine(cfg)
    outs = small.generate(prompts[-3:], GREEDY)
    assert [o.token_ids for o in outs] == one_at_a_time[-3:]


class _StandaloneModel:
    """The bare model over a private cache, to compare prefill strategies."""

    BLOCK = 16

    def __init__(self, model: DecoderModel, blocks: int = 32, kv_dtype: str = "float32") -> None:
        self.model = model
        cfg = self.model.config
        shape = (2 * blocks, self.BLOCK, cfg.num_kv_heads, cfg.head_dim)
        dtype = getattr(torch, kv_dtype)
        nan = reference.to_cache(torch.full(shape, float("nan")), dtype)  # int8: NaN scales
        self.caches = [(nan.clone(), nan.clone()) for _ in range(cfg.num_layers)]
        self._nan = nan
        # A scattered block table: block i of the sequence lives at block 2 * blocks - 1 - 2i.
        self.table = [2 * blocks - 1 - 2 * i for i in range(blocks)]

    def all_logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits of every position of one prefill of ``ids``."""
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [self.table], self.BLOCK)
        hidden = self.model.forward(torch.tensor(ids), torch.arange(len(ids)), self.caches, meta)
        return self.model.compute_logits(hidden)

    def prefill_logits(self, ids: list[int], chunk: int) -> torch.Tensor:
        for c in self.caches:
            c[0].copy_(self._nan)
            c[1].copy_(self._nan)
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            meta = AttentionMetadata.build([end - start], [end], [self.table], self.BLOCK)
            hidden = self.model.forward(
                torch.tensor(ids[start:end]), torch.arange(start, end), self.caches, meta
            )
        return self.model.compute_logits(hidden[-1:])[0]

    def cache_rows(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        slots = torch.tensor(
            [self.table[p // self.BLOCK] * self.BLOCK + p % self.BLOCK for p in range(n)]
        )
        return [
            (k.flatten(0, 1)[slots].clone(), v.flatten(0, 1)[slots].clone()) for k, v in self.caches
        ]

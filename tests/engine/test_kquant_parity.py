"""The embedded SmolLM2 requantized by llama.cpp's llama-quantize to Q4_K_M (a real file:
Q4_K, Q6_K, Q5_0 and Q8_0 tensors, mixed inside fused projections) and to IQ4_XS (IQ4_XS,
IQ4_NL, Q5_K, Q8_0), served from its
blocks: greedy tokens identical to transformers loading the same file, which dequantizes
it with gguf-py (the kernels' oracle). Skipped until ``make llama-quantize`` has built
the tool (bench/requantize.py says how)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench import requantize
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from kernels.cpu.library import available
from tests.engine.test_kquant_models import _hf_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="the CPU kernels do not build here"),
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]
NEW_TOKENS = 24


# llama-quantize types: Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0) and IQ4_XS (IQ4_XS where rows are
# multiples of 256, IQ4_NL for SmolLM2's 576-wide ones, a few Q5_K and Q8_0).
KINDS = ["Q4_K_M", "IQ4_XS"]


@pytest.fixture(scope="module", params=KINDS)
def requantized(request) -> Path:
    return _requantized_or_skip(request.param)


def test_greedy_parity_with_transformers(requantized):
    transformers = pytest.importorskip("transformers")
    engine = Engine(
        EngineConfig(
            model=str(requantized),
            cache=CacheConfig(num_blocks=64),
            device=DeviceConfig(device="cpu", cpu_kernels="native", weights="quantized"),
        )
    )
    model = engine.runner.model
    assert engine.weights == "quantized" and model.fused_layers
    formats = set()
    for layer in model.layers:
        for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            parts = proj.quantized.parts or (proj.quantized,)
            formats |= {part.format.name for part in parts}
    # Nothing fell back to dense; the file's own types are computed from their blocks.
    expected = {"q4_k", "q6_k"} if "Q4_K" in requantized.name else {"iq4_nl", "iq4_xs"}
    assert expected <= formats, formats
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(requantized.parent), gguf_file=requantized.name, dtype=torch.float32
    ).eval()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.generate([ids], params)[0].token_ids
        assert ours == _hf_greedy(hf, ids, NEW_TOKENS), prompt


def _engine(path: Path, weights: str) -> Engine:
    device = DeviceConfig(device="cpu", cpu_kernels="native", weights=weights)
    return Engine(EngineConfig(model=str(path), cache=CacheConfig(num_blocks=64), device=device))


def _requantized_or_skip(kind: str) -> Path:
    cached = requantize.cache_dir() / "models" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if requantize.quantize_tool() is None and not cached.is_file():
        pytest.skip("llama-quantize is not built: run `make llama-quantize`")
    return requantize.requantized(kind)


def test_int8_on_the_q4_k_m_file_agrees_with_the_exact_path():
    """--weights quantized-int8 on the real Q4_K_M file: its Q5_0 matrices (most of the
    file) run from their own blocks in the int8 kernel's tiled Q5_0 (not widened to Q8_0),
    its Q4_K and Q6_K ones (down) in their tiled layouts (not converted to Q4_1);
    the teacher-forced agreement and perplexity delta the int8 parity tests demand
    (tests/engine/test_parity.py MODES), here against the exact path on the same file, and
    batched decoding gives each prompt's tokens alone."""
    path = _requantized_or_skip("Q4_K_M")
    exact, int8 = _engine(path, "quantized"), _engine(path, "quantized-int8")
    model = int8.runner.model
    assert int8.weights == "quantized-int8" and model.fused_layers
    q5_0 = [p.quantized for layer in model.layers for p in (layer.o_proj, layer.gate_up)]
    assert all(w.format.name == "q5_0" and w.tiled_layout for w in q5_0)
    down = [layer.down.quantized for layer in model.layers]
    assert {w.format.name for w in down} == {"q4_k", "q6_k"}
    assert all(w.tiled_layout for w in down)
    _assert_int8_agrees_with_exact(exact, int8)


def test_int8_on_the_iq4_xs_file_agrees_with_the_exact_path():
    """--weights quantized-int8 on the real IQ4_XS file: its IQ4_NL matrices (every 576-wide
    one) and IQ4_XS ones (most of down) run from their own blocks in the int8 kernel's
    tiled layouts (not requantized to Q8_0), as many bytes as the file's; the agreement,
    perplexity and batching checks of the Q4_K_M file's test."""
    path = _requantized_or_skip("IQ4_XS")
    exact, int8 = _engine(path, "quantized"), _engine(path, "quantized-int8")
    model = int8.runner.model
    assert int8.weights == "quantized-int8" and model.fused_layers
    nl = [p.quantized for layer in model.layers for p in (layer.qkv, layer.o_proj, layer.gate_up)]
    assert all(w.format.name == "iq4_nl" and w.tiled_layout for w in nl)
    assert all(w.nbytes == -(-w.rows // 16) * 16 * w.cols // 32 * 18 for w in nl)
    down = [layer.down.quantized for layer in model.layers]
    assert {w.format.name for w in down} == {"iq4_xs", "q5_k"}
    assert all(w.tiled_layout for w in down)
    _assert_int8_agrees_with_exact(exact, int8)


def _assert_int8_agrees_with_exact(exact: Engine, int8: Engine) -> None:
    from tests.engine.test_parity import MODES, TEXT, _StandaloneModel

    model = int8.runner.model
    ids = exact.tokenizer.encode(TEXT)
    blocks = -(-len(ids) // 16)
    ref = _StandaloneModel(exact.runner.model, blocks=blocks).all_logits(ids)
    got = _StandaloneModel(model, blocks=blocks).all_logits(ids)
    target = torch.tensor(ids[1:])
    agreement = (got[:-1].argmax(-1) == ref[:-1].argmax(-1)).float().mean().item()
    ppl_got = math.exp(torch.nn.functional.cross_entropy(got[:-1], target).item())
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(ref[:-1], target).item())
    min_agreement, max_ppl_delta = MODES["quantized-int8"]
    assert agreement >= min_agreement, agreement
    assert abs(ppl_got / ppl_ref - 1) <= max_ppl_delta, (ppl_got, ppl_ref)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [int8.tokenizer.encode(p) for p in PROMPTS]
    alone = [int8.generate([p], params)[0].token_ids for p in prompts]
    assert [out.token_ids for out in int8.generate(prompts, params)] == alone

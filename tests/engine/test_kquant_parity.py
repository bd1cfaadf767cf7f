"""The embedded SmolLM2 requantized by llama.cpp's llama-quantize to Q4_K_M (a real file:
Q4_K, Q6_K, Q5_0 and Q8_0 tensors, mixed inside fused projections) and to IQ4_XS (IQ4_XS,
IQ4_NL, Q5_K, Q8_0), served from its
blocks: greedy tokens identical to transformers loading the same file, which dequantizes
it with gguf-py (the kernels' oracle). Skipped until ``make llama-quantize`` has built
the tool (bench/requantize.py says how)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import requantize
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from kernels.cpu import launch as cpu
from tests.engine.test_kquant_models import _hf_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu.available(), reason="the CPU kernels do not build here"),
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
    kind = request.param
    cached = requantize.cache_dir() / "models" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if requantize.quantize_tool() is None and not cached.is_file():
        pytest.skip("llama-quantize is not built: run `make llama-quantize`")
    return requantize.requantized(kind)


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

"""The embedded SmolLM2 requantized to Q4_K_M by llama.cpp's llama-quantize (a real file:
Q4_K, Q6_K, Q5_0 and Q8_0 tensors, mixed inside fused projections), served from its
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


@pytest.fixture(scope="module")
def q4_k_m() -> Path:
    if (
        requantize.quantize_tool() is None
        and not (requantize.cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_K_M.gguf").is_file()
    ):
        pytest.skip("llama-quantize is not built: run `make llama-quantize`")
    return requantize.requantized("Q4_K_M")


def test_q4_k_m_greedy_parity_with_transformers(q4_k_m):
    transformers = pytest.importorskip("transformers")
    engine = Engine(
        EngineConfig(
            model=str(q4_k_m),
            cache=CacheConfig(num_blocks=64),
            device=DeviceConfig(device="cpu", cpu_kernels="native", weights="quantized"),
        )
    )
    model = engine.runner.model
    assert engine.weights == "quantized" and model.fused_layers
    kinds = {p.quantized.format.name for layer in model.layers for p in (layer.qkv, layer.down)}
    assert "stacked" in kinds or "q6_k" in kinds  # the file mixes Q6_K in, as llama.cpp does
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(q4_k_m.parent), gguf_file=q4_k_m.name, dtype=torch.float32
    ).eval()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.generate([ids], params)[0].token_ids
        assert ours == _hf_greedy(hf, ids, NEW_TOKENS), prompt

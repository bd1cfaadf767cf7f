"""The model families of test_model_families.py from GGUF: the tiny transformers checkpoints
converted by llama.cpp's own convert_hf_to_gguf.py (`make llama-cpp-convert`; skipped
without it), served by the Engine; greedy tokens must equal transformers' on the same weights.

- f32 files: the weights are the checkpoint's, bit for bit, so the tokens must equal
  transformers' on the original model (RoPE from the file's metadata and rope_freqs tensor).
- q8_0 files, --weights quantized (the blocks on the CPU kernels, fp32 math): the reference
  is transformers with the file's dequantized weights loaded in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.engine import Engine
from compute.loaders import load_model
from compute.tokenizer import Tokenizer
from tests.engine.test_model_families import GREEDY, PROMPTS, build_hf_model, hf_greedy

pytestmark = pytest.mark.slow

LLAMA_CPP_PY = "0.3.36"  # the Makefile's LLAMA_CPP_PY
CONVERTER_DIR = (
    Path(os.environ.get("HEADRACE_LLAMA_CPP_DIR", Path.home() / ".cache/headrace/llama-cpp"))
    / f"llama_cpp_python-{LLAMA_CPP_PY}/vendor/llama.cpp"
)
# Families whose converted file headrace reads (Phi-3's and Gemma 2's converters need a
# SentencePiece tokenizer.model, which these checkpoints do not have; Mistral's converts to
# the llama architecture without its sliding window, so the file is not the same model).
GGUF_FAMILIES = ("llama3", "llama-linear", "qwen3", "gemma3")
# llama.cpp scales Gemma's attention by head_dim ** -0.5 whatever query_pre_attn_scalar says
# (but on the 27B models), and the converter writes no layer types (llama.cpp's Gemma 3
# pattern: five sliding layers, then a full one), so the checkpoint converted here has both
# as llama.cpp assumes.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
OVERRIDES = {
    "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6, "layer_types": GEMMA3_LAYERS}
}


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    script = CONVERTER_DIR / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    env = {**os.environ, "PYTHONPATH": str(CONVERTER_DIR / "gguf-py")}
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def engine_for(path: Path, weights: str, kernels: str = "native") -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
            device=DeviceConfig(device="cpu", cpu_kernels=kernels, weights=weights),
        )
    )


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def converted(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, hf model, f32 GGUF, q8_0 GGUF, prompt ids)."""
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model = build_hf_model(root / "hf", request.param, **OVERRIDES.get(request.param, {}))
    f32 = convert(root / "hf", root / "model-f32.gguf", "f32")
    q8 = convert(root / "hf", root / "model-q8_0.gguf", "q8_0")
    tok = Tokenizer.from_hf_dir(root / "hf")
    return request.param, model, f32, q8, [tok.encode(p) for p in PROMPTS]


def test_f32_gguf_greedy_equals_transformers(converted) -> None:
    name, model, f32, _, prompts = converted
    loaded = load_model(str(f32), progress=False)
    if name == "llama3":
        assert loaded.config.rope_freq_factors is not None  # the converter's rope_freqs
    if name == "qwen3":
        assert loaded.config.qk_norm and loaded.config.head_dim == 32
    if name == "gemma3":
        cfg = loaded.config
        assert cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.qk_norm
        assert cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
        assert cfg.layer_types == ("sliding",) * 5 + ("full",)
    # The file's tokenizer is the checkpoint's.
    assert [loaded.tokenizer.encode(p) for p in PROMPTS] == prompts
    expected = hf_greedy(model, prompts)
    for kernels in ("torch", "native"):
        engine = engine_for(f32, "dense", kernels)
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected, kernels


def test_q8_0_gguf_quantized_greedy_equals_transformers_on_its_weights(converted) -> None:
    name, model, _, q8, prompts = converted
    dense = load_model(str(q8), progress=False).weights  # the file's weights, dequantized
    if name == "gemma3":  # the converter folded Gemma's (1 + w) into its norms: unfold
        dense = {k: v - 1 if k.endswith("norm.weight") else v for k, v in dense.items()}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    expected = hf_greedy(model, prompts)
    engine = engine_for(q8, "quantized")
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
    alone = [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]
    assert alone == expected
    torch.testing.assert_close(
        dense["model.embed_tokens.weight"], model.get_input_embeddings().weight
    )

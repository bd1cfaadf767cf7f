"""Random weights in the shapes of known models, for benchmarks and tests (`dummy:<shape>`).

Step time depends on shapes, not values, so GPU benchmarks of bigger Llama-family models run on
seeded random weights generated directly in the target dtype and device (an 8B model never
exists in fp32 on the host).
"""

from __future__ import annotations

import torch

from compute.core.config import ModelConfig
from compute.loaders.base import DUMMY_PREFIX, LoadedModel, ModelLoadError, expected_shapes

INIT_STD = 0.02  # the usual initializer range of Llama-family configs

SHAPES: dict[str, ModelConfig] = {
    # A model small enough for fast CPU tests of the whole engine.
    "tiny": ModelConfig(
        name="dummy-tiny", architecture="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        name="dummy-smollm2-135m", architecture="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        name="dummy-llama-3.2-1b", architecture="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), rope_type="llama3",
        rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="dummy-qwen2.5-0.5b", architecture="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True, qkv_bias=True, eos_token_ids=(151645, 151643),
    ),
    "llama-3-8b": ModelConfig(
        name="dummy-llama-3-8b", architecture="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
}  # fmt: skip


def dummy_config(shape: str) -> ModelConfig:
    """The ModelConfig of a named dummy shape; ModelLoadError listing the known ones."""
    if shape not in SHAPES:
        raise ModelLoadError(
            f"{DUMMY_PREFIX}{shape}: unknown dummy shape (known: {', '.join(SHAPES)})"
        )
    return SHAPES[shape]


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded N(0, INIT_STD) matrices and all-ones norms, made in place on `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)  # RMSNorm gains start at one; random gains would distort scale
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        weights[name] = tensor
    return weights


def load_dummy(
    shape: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> LoadedModel:
    """`dummy:<shape>` as a LoadedModel without a tokenizer."""
    config = dummy_config(shape)
    weights = dummy_weights(config, dtype, device, seed)
    return LoadedModel(config=config, weights=weights, tokenizer=None, source=DUMMY_PREFIX + shape)

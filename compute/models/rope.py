"""RoPE inverse frequencies for every RoPE type headrace serves, as transformers computes them.

The model builds its cos/sin table from these once (compute/models/decoder.py RotaryEmbedding), so a
RoPE variant costs nothing per step and needs no kernel of its own. A type not listed in
compute.core.config.ROPE_TYPES never gets here: the loaders refuse it.
"""

from __future__ import annotations

import math

import torch

from compute.core.config import ModelConfig


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """HF's _compute_default_rope_parameters: base^(-2i/d) for i < d/2, fp32."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies of `config`'s RoPE."""
    freq = default_inv_freq(config.head_dim, config.rope_theta)
    if config.rope_freq_factors is not None:  # a GGUF file's rope_freqs: llama.cpp divides
        freq = freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if config.rope_type == "linear":
        return freq / config.rope_factor
    if config.rope_type == "llama3":
        return _llama3(freq, config)
    return freq


def _llama3(freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """transformers' _compute_llama3_parameters, op for op: long wavelengths divided by the
    factor, short ones kept, the band between interpolated."""
    factor = config.rope_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old_context = config.rope_original_max_position
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)

"""A Llama-family decoder over a paged KV cache.

The model sees a flat, unpadded batch ``(token_ids, positions)`` and one
``AttentionMetadata``; it knows nothing of requests or scheduling. Weights
arrive with Hugging Face Llama names (compute/loader.py) and are fused here
(q|k|v and gate|up) so each layer runs four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute.config import ModelConfig
from kernels import ops
from kernels.metadata import AttentionMetadata


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, H]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [H, q_size]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]


class RotaryEmbedding:
    """HF-layout RoPE (rotate_half) with a cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, base: float, max_positions: int, device, dtype) -> None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.half = head_dim // 2

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; returns x rotated by its token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        """Build from HF-named weights. Per-layer tensors are popped from ``weights``
        as they are fused, so peak memory stays near one copy of the model."""
        self.config = config
        embed = weights["model.embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        self.embed_tokens = embed
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", embed)
        self.layers = [_fuse_layer(weights, i, config) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.max_position_embeddings,
            self.device,
            self.dtype,
        )
        self.scale = config.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, H] after the final norm, for every token of the batch."""
        hidden = F.embedding(token_ids, self.embed_tokens)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
            attn_in = self._rms_norm(hidden, layer.input_norm)
            hidden = hidden + self._attention(
                attn_in, positions, layer, key_cache, value_cache, meta
            )
            mlp_in = self._rms_norm(hidden, layer.post_norm)
            hidden = hidden + self._mlp(mlp_in, layer)
        return self._rms_norm(hidden, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] for the given rows of hidden states."""
        return F.linear(hidden, self.lm_head).float()

    def _attention(self, x, positions, layer: LayerWeights, key_cache, value_cache, meta):
        cfg = self.config
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = self.rope(q.view(-1, cfg.num_heads, cfg.head_dim), positions)
        k = self.rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), positions)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        # The step's K/V must be in the cache before attention reads it.
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = ops.paged_attention(q, key_cache, value_cache, meta, self.scale)
        return F.linear(out.reshape(-1, cfg.q_size), layer.o_proj)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same op order as HF's LlamaRMSNorm, in fp32, so fp32 parity is exact-ish.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)


def _fuse_layer(weights: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> LayerWeights:
    p = f"model.layers.{i}."

    def w(name: str) -> torch.Tensor:
        if p + name not in weights:
            raise ValueError(f"weights: missing tensor {p + name}")
        return weights.pop(p + name)

    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = torch.cat([w(f"self_attn.{n}_proj.bias") for n in "qkv"])
    return LayerWeights(
        input_norm=w("input_layernorm.weight"),
        qkv=torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),
        qkv_bias=qkv_bias,
        o_proj=w("self_attn.o_proj.weight").contiguous(),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).contiguous(),
        down=w("mlp.down_proj.weight").contiguous(),
    )

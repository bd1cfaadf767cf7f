"""A Llama-family decoder over a paged KV cache.

The model sees a flat, unpadded batch ``(token_ids, positions)`` and one
``AttentionMetadata``; it knows nothing of requests or scheduling. Weights
arrive with Hugging Face Llama names (compute/loaders/) and are fused here
(q|k|v and gate|up) so each layer runs four matmuls.

On the CPU each projection also keeps a transposed copy, ``[in, out]``, used
as ``x @ w_t`` when a step has at most two rows: there that layout reaches
about twice the memory bandwidth of ``F.linear`` over ``[out, in]`` (measured
on this project's 2-core machine: 30 layer-sized matrices at batch 1, 13.3 ms
-> 7.9 ms; a whole decode step, 59 -> 43 ms), while from four rows on the
usual layout is ~8% faster. The copy costs one more model's worth of RAM.
GPUs keep one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute.core.config import ModelConfig
from kernels import ops
from kernels.metadata import AttentionMetadata

# Rows up to which the transposed copy is faster (see the module docstring).
_GEMV_ROWS = 2


class Projection:
    """A linear layer's weight [out, in] (+ bias), with a transposed CPU copy for GEMVs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.weight_t = weight.t().contiguous() if weight.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] <= _GEMV_ROWS:
            out = x @ self.weight_t
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # [q_size + 2 * kv_size, H]
    o_proj: Projection  # [H, q_size]
    post_norm: torch.Tensor  # [H]
    gate_up: Projection  # [2 * I, H]
    down: Projection  # [H, I]


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
        self.lm_head = Projection(weights.get("lm_head.weight", embed))
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
        return self.lm_head(hidden).float()

    def _attention(self, x, positions, layer: LayerWeights, key_cache, value_cache, meta):
        cfg = self.config
        qkv = layer.qkv(x)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = self.rope(q.view(-1, cfg.num_heads, cfg.head_dim), positions)
        k = self.rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), positions)
        v = v.contiguous().view(-1, cfg.num_kv_heads, cfg.head_dim)  # a column slice of qkv
        # The step's K/V must be in the cache before attention reads it.
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = ops.paged_attention(q, key_cache, value_cache, meta, self.scale)
        return layer.o_proj(out.reshape(-1, cfg.q_size))

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

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
        qkv=Projection(torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"]), qkv_bias),
        o_proj=Projection(w("self_attn.o_proj.weight")),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=Projection(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])),
        down=Projection(w("mlp.down_proj.weight")),
    )

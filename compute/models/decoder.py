"""The decoder every supported family runs: Llama's, with each family's deltas (Gemma's
sandwich norms, soft-caps and GeGLU, Qwen's q/k norms and biases, sliding windows, MoE)
over a paged KV cache.

The model sees a flat, unpadded batch ``(token_ids, positions)`` and one
``AttentionMetadata``; it knows nothing of requests or scheduling. Weights
arrive with Hugging Face Llama names (compute/loaders/) and are fused here
(q|k|v and gate|up) so each layer runs four matmuls.

Two ways to run on the CPU, chosen by the engine (``native``):

- the CPU kernels (kernels/cpu/): weights may stay in the GGUF file's blocks
  (kernels/cpu/quant.py) and are expanded in registers inside each matmul; RMSNorm with
  its residual add, RoPE with the cache write, attention over the paged cache and
  SiLU * up are one call each;
- torch (the reference and the GPU path): dense weights; each dense projection keeps
  a transposed copy ``[in, out]`` on the CPU, used as ``x @ w_t`` for steps of at most
  two rows, where that layout reaches about twice the memory bandwidth of ``F.linear``
  over ``[out, in]`` (measured on this project's 2-core machine: a whole decode step,
  59 -> 43 ms). GPUs keep one layout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute.core.config import ModelConfig
from compute.models import rope
from compute.models.moe import Expert, MoE
from kernels import ops
from kernels.cpu import decoder as cpu_decoder
from kernels.cpu.attention import paged_attention, rope_and_cache
from kernels.cpu.elementwise import add_rms_norm, gelu_tanh_mul, head_rms_norm, rms_norm, silu_mul
from kernels.cpu.library import use_torch_threads
from kernels.cpu.quant import QuantizedWeight
from kernels.cpu.quant_linear import dequantize_rows, quant_linear
from kernels.metadata import AttentionMetadata

# Rows up to which the transposed copy is faster (see the module docstring).
_GEMV_ROWS = 2


class Projection:
    """A linear layer: a dense weight [out, in] (+ bias), or one in quantized blocks."""

    def __init__(
        self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, int8=False
    ) -> None:
        self.bias, self.int8 = bias, int8
        self.quantized = weight if isinstance(weight, QuantizedWeight) else None
        if self.quantized is not None and int8:  # the int8 kernel's formats and layout
            self.quantized = self.quantized.for_int8().tiled()
        self.weight = None if self.quantized else weight.contiguous()
        on_cpu = self.weight is not None and self.weight.device.type == "cpu"
        self.weight_t = self.weight.t().contiguous() if on_cpu else None

    def __call__(self, x: torch.Tensor, check: bool = True) -> torch.Tensor:
        if self.quantized is not None:
            return quant_linear(x, self.quantized, self.bias, self.int8, check)
        if self.weight_t is not None and x.shape[0] <= _GEMV_ROWS:
            out = x @ self.weight_t
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


def fuse(
    parts: Sequence[torch.Tensor | QuantizedWeight], int8: bool = False
) -> torch.Tensor | QuantizedWeight:
    """Stack the rows of several weights (q|k|v, gate|up). Quantized parts stay quantized
    when they share a block format, or as a stack of their formats (int8: each part in
    its tiled layout); else they are dequantized (exactly) to fp32."""
    if int8 and any(isinstance(p, QuantizedWeight) and p.format.file_order for p in parts):
        # The int8 kernel's formats (kernels/cpu/quant.py for_int8).
        parts = [p.for_int8() if isinstance(p, QuantizedWeight) else p for p in parts]
    if all(isinstance(p, QuantizedWeight) for p in parts):
        try:
            return QuantizedWeight.cat(parts)  # type: ignore[arg-type]
        except ValueError:
            # Formats that differ: a stack, each part in its own (int8: in its tiled layout).
            tiled = [p.tiled() for p in parts] if int8 else parts
            return QuantizedWeight.stack(tiled)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # [q_size + 2 * kv_size, H]
    o_proj: Projection  # [H, q_size]
    post_norm: torch.Tensor  # [H]
    gate_up: Projection | None  # [2 * I, H]; None on a mixture-of-experts layer
    down: Projection | None  # [H, I]
    q_norm: torch.Tensor | None = None  # [D], Qwen3's RMSNorm of each q head before RoPE
    k_norm: torch.Tensor | None = None  # [D], the same for each k head
    # The mixture-of-experts MLP (compute/models/moe.py), in place of gate_up/down.
    moe: MoE | None = None
    # Gemma's sandwich norms: RMSNorm of the attention / MLP output before its residual add
    # (HF post_attention_layernorm / post_feedforward_layernorm; post_norm is then HF's
    # pre_feedforward_layernorm, the MLP's input norm).
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None  # the layer's sliding window (tokens), None = full attention
    local_rope: bool = False  # RoPE of the sliding layers' own base (Gemma 3)


class RotaryEmbedding:
    """HF-layout RoPE (rotate_half) with a cos/sin table indexed by absolute position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device, dtype) -> None:
        """inv_freq: [head_dim / 2] fp32 (compute/models/rope.py, any RoPE type)."""
        head_dim = 2 * inv_freq.shape[0]
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


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        native: bool = False,
        int8: bool = False,
    ) -> None:
        """Build from HF-named weights. Per-layer tensors are popped from ``weights``
        as they are fused, so peak memory stays near one copy of the model.
        ``native``: run on the CPU kernels (fp32, CPU only; quantized weights need it);
        ``int8``: quantized matmuls take int8 activations (kernels/cpu/quant_linear.py)."""
        self.config = config
        embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.device, self.dtype = self.norm.device, self.norm.dtype
        self.native = native
        self.quantized = any(isinstance(w, QuantizedWeight) for w in weights.values())
        if self.quantized and not native:
            raise ValueError("weights: quantized weights run only on the CPU kernels (native)")
        self.lm_head = Projection(weights.get("lm_head.weight", embed), int8=int8)
        tied = "lm_head.weight" not in weights and self.lm_head.quantized is not None
        self.embed_tokens = self.lm_head.quantized if tied else embed  # one copy when tied
        self.layers = [
            _fuse_layer(weights, i, config, int8, native) for i in range(config.num_layers)
        ]
        self.rope, self.local_rope = _rotary_embeddings(config, self.device, self.dtype)
        self.scale = config.attn_scale
        # Every layer in one kernel call (kernels/cpu/decoder.py decoder_layers) when every
        # projection is quantized: bit-identical to the per-op path, ~1.4 ms less Python
        # per step. Tests turn it off to compare the two.
        # Per-head q/k norms (Qwen3, Gemma 3), Gemma's deltas (output norms, GeGLU, the
        # attention soft-cap, the sliding layers' RoPE tables) and mixture-of-experts layers
        # whose experts have a kernel table (router and experts, compute/models/moe.py) are in it.
        self.fused_layers = (
            native
            and config.hidden_act in ("silu", "gelu_tanh")
            and all(_fusable(layer) for layer in self.layers)
        )
        # The fused call's (cache pointers, layer table, statics), built at its first step.
        self._table: tuple[tuple[int, ...], ctypes.Array, cpu_decoder.DecoderStatics] | None = None

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, H] after the final norm, for every token of the batch."""
        if self.native:
            use_torch_threads()
        hidden = self._embed(token_ids)  # the residual stream, updated in place
        x = self._rms_norm(hidden, self.layers[0].input_norm)
        if self.fused_layers and sum(meta.query_lens) == token_ids.shape[0]:
            table, statics = self._decoder_table(kv_caches)
            return cpu_decoder.decoder_layers(table, statics, x, hidden, positions, meta)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, (key_cache, value_cache) in zip(
            self.layers, norms, kv_caches, strict=True
        ):
            # The CPU kernels' arguments are checked at the first layer; the other layers
            # see tensors of the same shapes, made by the kernels themselves.
            check = layer is self.layers[0]
            attn = self._attention(x, positions, layer, key_cache, value_cache, meta, check)
            if layer.attn_out_norm is not None:
                attn = self._rms_norm(attn, layer.attn_out_norm)
            x = self._add_norm(attn, hidden, layer.post_norm, check)
            mlp = self._mlp(x, layer, check)
            if layer.mlp_out_norm is not None:
                mlp = self._rms_norm(mlp, layer.mlp_out_norm)
            x = self._add_norm(mlp, hidden, next_norm, check)
        return x

    def _decoder_table(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[ctypes.Array, cpu_decoder.DecoderStatics]:
        """decoder_layers' table and statics, rebuilt only when the caches are other tensors."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._table is None or self._table[0] != key:
            cfg, local = self.config, self.local_rope
            table = cpu_decoder.decoder_table(
                self.layers, self.norm, kv_caches, None if local is None else (local.cos, local.sin)
            )
            statics = cpu_decoder.decoder_statics(
                self.layers, kv_caches[0], (self.rope.cos, self.rope.sin), num_heads=cfg.num_heads,
                eps=cfg.rms_norm_eps, scale=self.scale, gelu=cfg.hidden_act == "gelu_tanh",
                softcap=cfg.attn_logit_softcap,
            )  # fmt: skip
            self._table = (key, table, statics)
        return self._table[1:]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] for the given rows of hidden states (soft-capped: Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # transformers' order: / cap, tanh, * cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, QuantizedWeight):
            embeds = dequantize_rows(self.embed_tokens, token_ids)
        else:
            embeds = F.embedding(token_ids, self.embed_tokens)
        if self.config.embed_scale != 1.0:  # Gemma: times sqrt(hidden), rounded to the dtype
            embeds = embeds * torch.tensor(self.config.embed_scale, dtype=embeds.dtype)
        return embeds

    def _attention(self, x, positions, layer, key_cache, value_cache, meta, check=True):
        cfg = self.config
        qkv = layer.qkv(x, check)
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer)
        rope = self.local_rope if layer.local_rope else self.rope
        softcap = cfg.attn_logit_softcap
        if self.native:
            q = rope_and_cache(
                qkv, positions, rope.cos, rope.sin, key_cache, value_cache,
                meta.slot_mapping, cfg.num_heads, check,
            )  # fmt: skip
            out = paged_attention(
                q, key_cache, value_cache, meta, self.scale, check, layer.window, softcap
            )
            return layer.o_proj(out.view(-1, cfg.q_size), check)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = rope(q.view(-1, cfg.num_heads, cfg.head_dim), positions)
        k = rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), positions)
        v = v.contiguous().view(-1, cfg.num_kv_heads, cfg.head_dim)  # a column slice of qkv
        # The step's K/V must be in the cache before attention reads it.
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = ops.paged_attention(
            q, key_cache, value_cache, meta, self.scale, layer.window, softcap
        )
        return layer.o_proj(out.reshape(-1, cfg.q_size))

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """RMSNorm of each q and k head of the fused qkv [T, (H + 2 Hkv) D], in place, before
        RoPE: one CPU kernel call per part, or a few small torch ops (HF Qwen3RMSNorm's order)."""
        cfg = self.config
        for start, heads, weight in (
            (0, cfg.num_heads, layer.q_norm),
            (cfg.q_size, cfg.num_kv_heads, layer.k_norm),
        ):
            if self.native:  # one kernel call instead of a few small torch ops
                head_rms_norm(qkv, weight, start, heads, cfg.rms_norm_eps)
                continue
            part = qkv[:, start : start + heads * cfg.head_dim].view(-1, heads, cfg.head_dim)
            xf = part.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
            part.copy_(weight * xf.to(part.dtype))

    def _mlp(self, x: torch.Tensor, layer: LayerWeights, check: bool = True) -> torch.Tensor:
        if layer.moe is not None:
            return layer.moe(x, check)
        gate_up = layer.gate_up(x, check)
        gelu = self.config.hidden_act == "gelu_tanh"
        if self.native:
            act = gelu_tanh_mul if gelu else silu_mul
            return layer.down(act(gate_up, check), check)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        return layer.down(gate * up)

    def _add_norm(self, x, hidden: torch.Tensor, weight: torch.Tensor, check: bool = True):
        """hidden += x (the residual), then the next sublayer's RMSNorm of it."""
        if self.native:
            return add_rms_norm(x, hidden, weight, self.config.rms_norm_eps, check)
        hidden.add_(x)
        return self._rms_norm(hidden, weight)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.native:
            return rms_norm(x, weight, self.config.rms_norm_eps)
        # Same op order as HF's LlamaRMSNorm, in fp32, so fp32 parity is exact-ish.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)


def _fusable(layer: LayerWeights) -> bool:
    """Whether hr_decoder_layers can run the layer: every projection quantized, a MoE
    MLP's experts in one kernel table (compute/models/moe.py)."""
    mlp = (layer.gate_up, layer.down) if layer.moe is None else ()
    quantized = all(p.quantized is not None for p in (layer.qkv, layer.o_proj, *mlp))
    return quantized and (layer.moe is None or layer.moe.table is not None)


def _fuse_layer(
    weights: dict, i: int, cfg: ModelConfig, int8: bool, native: bool = False
) -> LayerWeights:
    p = f"model.layers.{i}."

    def w(name: str):
        if p + name not in weights:
            raise ValueError(f"weights: missing tensor {p + name}")
        return weights.pop(p + name)

    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = torch.cat([w(f"self_attn.{n}_proj.bias") for n in "qkv"])
    extra: dict = {"window": cfg.layer_window(i)}
    extra["local_rope"] = cfg.rope_local_theta is not None and extra["window"] is not None
    if cfg.qk_norm:
        extra.update(q_norm=w("self_attn.q_norm.weight"), k_norm=w("self_attn.k_norm.weight"))
    post_norm = "post_attention_layernorm.weight"
    if cfg.sandwich_norms:
        extra["attn_out_norm"] = w("post_attention_layernorm.weight")
        extra["mlp_out_norm"] = w("post_feedforward_layernorm.weight")
        post_norm = "pre_feedforward_layernorm.weight"
    mlp = _moe_mlp(w, cfg, int8, native) if cfg.is_moe_layer(i) else _dense_mlp(w, int8)
    return LayerWeights(
        input_norm=w("input_layernorm.weight"),
        qkv=Projection(
            fuse([w(f"self_attn.{n}_proj.weight") for n in "qkv"], int8), qkv_bias, int8
        ),
        o_proj=Projection(w("self_attn.o_proj.weight"), int8=int8),
        post_norm=w(post_norm),
        **mlp,
        **extra,
    )


def _dense_mlp(w, int8: bool) -> dict:
    """A dense layer's MLP projections (``w``: the layer's weight by name, popped)."""
    gate_up = fuse([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], int8)
    return {
        "gate_up": Projection(gate_up, int8=int8),
        "down": Projection(w("mlp.down_proj.weight"), int8=int8),
    }


def _moe_mlp(w, cfg: ModelConfig, int8: bool, native: bool) -> dict:
    """A mixture-of-experts layer's MLP: its router and experts (``w`` as _dense_mlp's)."""
    experts = [
        Expert(
            gate_up=Projection(
                fuse([w(f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up")], int8),
                int8=int8,
            ),
            down=Projection(w(f"mlp.experts.{e}.down_proj.weight"), int8=int8),
        )
        for e in range(cfg.num_experts)
    ]
    moe = MoE(w("mlp.gate.weight"), experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, native)
    return {"gate_up": None, "down": None, "moe": moe}


def _rotary_embeddings(
    config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The model's RoPE, and its sliding layers' (Gemma 3: default RoPE of their own base;
    None without)."""
    positions = config.max_position_embeddings
    local = None
    if config.rope_local_theta is not None:
        local_freq = rope.default_inv_freq(config.head_dim, config.rope_local_theta)
        local = RotaryEmbedding(local_freq, positions, device, dtype)
    return RotaryEmbedding(rope.inv_freq(config), positions, device, dtype), local

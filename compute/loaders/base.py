"""What every loader shares: the LoadedModel record, ModelLoadError and the weight-shape check.

Every loader returns weights under HF Llama names, in [out, in] layout, in the requested dtype
and device, checked against the shapes the config implies, and raises ModelLoadError (naming
the file) for anything it cannot load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from compute.core.config import ModelConfig
from compute.tokenizer.chat_template import read_chat_template
from compute.tokenizer.tokenizer import Tokenizer
from kernels.cpu.quant import QuantizedWeight

DUMMY_PREFIX = "dummy:"
# Loading these runs arbitrary code (pickle), so they are refused outright.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelLoadError(ValueError):
    """A model source that cannot be loaded: missing, corrupt, unsupported or inconsistent."""


@dataclass
class LoadedModel:
    """What a loader hands the model runner."""

    config: ModelConfig
    # HF Llama names; lm_head.weight absent when tied; GGUF blocks when loaded quantized.
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Tokenizer | None  # None for dummy weights
    source: str  # resolved path, or "dummy:<shape>"


def read_template_flag(path: str) -> str:
    """The text of ``--chat-template``'s file, checked (read_chat_template) before any weight
    loads; ModelLoadError otherwise."""
    try:
        return read_chat_template(path)
    except ValueError as exc:
        raise ModelLoadError(f"--chat-template: {exc}") from exc


def with_chat_template(loaded: LoadedModel, chat_template: str) -> LoadedModel:
    """``loaded`` with ``chat_template`` in place of its own (``--chat-template``: a GGUF without
    ``tokenizer.chat_template``, or a template to fix). The end-of-turn tokens the template
    writes join the model's stop tokens. ModelLoadError for a model without a tokenizer."""
    if loaded.tokenizer is None:
        raise ModelLoadError(
            f"--chat-template: {loaded.source} has no tokenizer to apply a chat template with"
        )
    tokenizer = loaded.tokenizer.with_chat_template(chat_template)
    eos = loaded.config.eos_token_ids
    eos += tuple(i for i in tokenizer.eos_token_ids if i not in eos)
    config = dataclasses.replace(loaded.config, eos_token_ids=eos)
    return dataclasses.replace(loaded, config=config, tokenizer=tokenizer)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama-family model of this config needs, with its shape."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    projections = {
        "self_attn.q_proj": (config.q_size, hidden),
        "self_attn.k_proj": (config.kv_size, hidden),
        "self_attn.v_proj": (config.kv_size, hidden),
        "self_attn.o_proj": (hidden, config.q_size),
    }
    mlp = {
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        layer_mlp = moe_shapes(config) if config.is_moe_layer(i) else mlp
        for name, shape in {**projections, **layer_mlp}.items():
            shapes[f"{prefix}{name}.weight"] = shape
        if config.sandwich_norms:  # Gemma: norms of the attention and MLP outputs too
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"{prefix}{name}.weight"] = (hidden,)
        if config.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.qkv_bias:
            shapes[prefix + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[prefix + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[prefix + "self_attn.v_proj.bias"] = (config.kv_size,)
    return shapes


def moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts layer's tensors (under model.layers.N., without .weight): the
    router (mlp.gate) and each expert's SwiGLU MLP, HF Qwen3-MoE's per-expert names."""
    hidden, ffn = config.hidden_size, config.moe_intermediate_size
    shapes = {"mlp.gate": (config.num_experts, hidden)}
    for e in range(config.num_experts):
        shapes[f"mlp.experts.{e}.gate_proj"] = (ffn, hidden)
        shapes[f"mlp.experts.{e}.up_proj"] = (ffn, hidden)
        shapes[f"mlp.experts.{e}.down_proj"] = (hidden, ffn)
    return shapes


def check_weights(weights: dict, config: ModelConfig, source: str) -> None:
    """Raise ModelLoadError unless `weights` holds exactly the expected tensors and shapes."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:3])}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )

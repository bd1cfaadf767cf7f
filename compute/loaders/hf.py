"""Hugging Face checkpoint loader: `config.json` + safetensors (+ tokenizer) to HF-named weights.

Only safetensors are read, single-file or sharded with `model.safetensors.index.json`; pickled
checkpoints (`*.bin`, `*.pt`) are refused because unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from compute.core.config import ROPE_TYPES, ModelConfig
from compute.loaders.base import PICKLE_SUFFIXES, LoadedModel, ModelLoadError, check_weights
from compute.loaders.memory_check import check_fits
from compute.tokenizer.tokenizer import Tokenizer
from kernels.log import get_logger

log = get_logger(__name__)

# model_type -> the CausalLM class transformers would build; both spellings are accepted.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",  # mixture of experts (compute/models/moe.py)
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Gemma's deltas (compute/core/config.py): sqrt(hidden)-scaled embeddings, RMSNorms of
# (1 + weight) (folded into the weights at load), sandwich norms, GeGLU, query_pre_attn_scalar,
# soft-caps, alternating sliding / full layers (Gemma 3: each with its own RoPE base).
_GEMMA = ("gemma2", "gemma3_text")
# transformers' activation names -> ModelConfig.hidden_act; Llama-style families take silu only.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Model types whose `sliding_window` applies to every layer whenever it is set; Qwen2/3 apply
# it only with use_sliding_window, from layer max_window_layers on.
_WINDOW_EVERYWHERE = ("mistral", "phi3", "mixtral")
# Phi-3 stores q|k|v and gate|up fused; split at load into the names every loader gives.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}  # fmt: skip
# Mixtral's expert names -> Qwen3-MoE's, which every loader gives (compute/loaders/base.py).
_MIXTRAL_NAMES = (
    (".block_sparse_moe.gate.", ".mlp.gate."),
    (".block_sparse_moe.experts.", ".mlp.experts."),
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)
# Router settings of other MoE families that headrace does not implement (only softmax
# over every expert, then top-k): refused when present with a non-default value.
_ROUTER_SETTINGS = {
    "shared_expert_intermediate_size": (None, 0),  # Qwen2-MoE's shared expert
    "n_shared_experts": (None, 0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1.0),
}
_INDEX_FILE = "model.safetensors.index.json"
_PICKLE_GLOBS = tuple(f"*{suffix}" for suffix in PICKLE_SUFFIXES)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed buffers some old exports saved


def load_hf_dir(
    path: Path, dtype: torch.dtype, device: str | torch.device, progress: bool = True
) -> LoadedModel:
    """Read a checkpoint directory: config, tokenizer and safetensors weights."""
    raw = _read_json(path / "config.json")
    files = _weight_files(path)  # first, so a pickle-only checkpoint is refused up front
    tokenizer = _tokenizer(path)
    config = _config(raw, path, tokenizer)
    check_fits(_weights_bytes(files, dtype), str(path))
    weights = _read_weights(files, config, dtype, device, progress)
    check_weights(weights, config, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ModelLoadError(f"{file}: missing (not a Hugging Face checkpoint directory?)") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{file}: unreadable JSON: {err}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object")
    return data


def _tokenizer(path: Path) -> Tokenizer:
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path / 'tokenizer.json'}: missing (a fast tokenizer is required)")
    try:
        return Tokenizer.from_hf_dir(path)
    except Exception as err:  # tokenizers raises plain Exception for a bad tokenizer.json
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {err}") from err


def _model_type(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    if model_type is None:
        by_class = {cls: kind for kind, cls in SUPPORTED_MODEL_TYPES.items()}
        model_type = next(
            (by_class[a] for a in raw.get("architectures", []) if a in by_class), None
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path / 'config.json'}: unsupported architecture {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelLoadError(f"{path / 'config.json'}: o_proj/MLP biases are not supported")
    if raw.get("use_bidirectional_attention"):
        raise _refuse(path, "use_bidirectional_attention", "true (an encoder, not a decoder)")
    return model_type


def _refuse(path: Path, setting: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"{path / 'config.json'}: {setting}: {why}; headrace cannot serve it")


def _rope(raw: dict[str, Any], path: Path, model_type: str = "llama") -> dict[str, Any]:
    """ModelConfig's RoPE fields; a RoPE setting headrace does not honour is refused."""
    # transformers 5 nests RoPE settings under rope_parameters; 4.x kept them at the top level.
    params = raw.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if params and all(isinstance(v, dict) for v in params.values()):
        if model_type != "gemma3_text" or set(params) != {"full_attention", "sliding_attention"}:
            raise _refuse(path, "rope_parameters", f"per-layer-type RoPE ({', '.join(params)})")
        local, params = params["sliding_attention"], params["full_attention"]
    elif model_type == "gemma3_text":  # transformers 4.x
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise _refuse(
            path, "rope_parameters", f"sliding layers' RoPE type {local['rope_type']!r} "
            "(only default)"
        )  # fmt: skip
    scaling = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise _refuse(path, "partial_rotary_factor", f"{partial} (only 1.0, RoPE on every dim)")
    if rope_type not in ROPE_TYPES:
        raise _refuse(
            path, "rope_scaling", f"RoPE type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if local:
        fields["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    keys = {
        "default": {},
        "linear": {"factor": "rope_factor"},
        "llama3": {
            "factor": "rope_factor",
            "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor",
            "original_max_position_embeddings": "rope_original_max_position",
        },
    }[rope_type]
    for key, field in keys.items():
        if scaling.get(key) is None:
            raise _refuse(path, "rope_scaling", f"RoPE type {rope_type!r} without {key}")
        fields[field] = type(getattr(ModelConfig, field))(scaling[key])
    return fields


def _sliding_window(raw: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The attention window of the model's sliding layers, or None when no layer slides."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:  # transformers 5 spells out each layer's kind
        return int(window) if "sliding_attention" in layer_types else None
    if model_type in _WINDOW_EVERYWHERE or model_type in _GEMMA:
        return int(window)
    first = raw.get("max_window_layers", 0)
    return int(window) if raw.get("use_sliding_window") and first < num_layers else None


def _moe(raw: dict[str, Any], path: Path, model_type: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields ({} for a dense model); router settings
    headrace does not honour are refused."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    for key, defaults in _ROUTER_SETTINGS.items():
        if raw.get(key) not in defaults:
            raise _refuse(path, key, f"{raw[key]!r} (only a softmax top-k router, no shared "
                          "experts)")  # fmt: skip
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if model_type == "mixtral":  # always renormalises its top-k; every layer sparse
        ffn, norm, dense = int(raw["intermediate_size"]), True, ()
    else:
        ffn, norm = int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False))
        step, only = int(raw.get("decoder_sparse_step", 1)), raw.get("mlp_only_layers") or []
        dense = tuple(
            i for i in range(num_layers) if i in only or experts == 0 or step <= 0 or (i + 1) % step
        )
    if experts == 0:
        return {}
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": ffn,
        "norm_topk_prob": norm,
        "dense_layers": dense,
    }


def _layer_types(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention, "sliding" or "full", as transformers builds it."""
    names = raw.get("layer_types")
    if names is not None:
        return tuple("sliding" if t == "sliding_attention" else "full" for t in names)
    if model_type == "gemma2":  # transformers 4.x: even layers slide
        return tuple("full" if i % 2 else "sliding" for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    if model_type in _WINDOW_EVERYWHERE:
        return ("sliding",) * num_layers
    first = raw.get("max_window_layers", 0) if raw.get("use_sliding_window") else num_layers
    return tuple("sliding" if i >= first else "full" for i in range(num_layers))


def _gemma(raw: dict[str, Any], model_type: str, hidden: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields (none for other families)."""
    if model_type not in _GEMMA:
        return {}
    caps = {
        "attn_logit_softcap": raw.get("attn_logit_softcapping"),
        "final_logit_softcap": raw.get("final_logit_softcapping"),
    }
    scalar = raw.get("query_pre_attn_scalar")
    return {
        "embed_scale": hidden**0.5,
        "sandwich_norms": True,
        "qk_norm": model_type == "gemma3_text",
        "query_pre_attn_scalar": float(scalar) if scalar is not None else None,
        **{k: float(v) if v else None for k, v in caps.items()},
    }


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_ids(raw: dict[str, Any], path: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = _ids(raw.get("eos_token_id"))
    generation = path / "generation_config.json"
    if generation.is_file():
        ids += _ids(_read_json(generation).get("eos_token_id"))
    ids += tokenizer.eos_token_ids
    return tuple(dict.fromkeys(ids))  # de-duplicated, first mention first


def _config(raw: dict[str, Any], path: Path, tokenizer: Tokenizer) -> ModelConfig:
    model_type = _model_type(raw, path)
    if model_type in _GEMMA:  # Gemma reads hidden_activation (hidden_act is a legacy alias)
        activation = raw.get("hidden_activation") or raw.get("hidden_act", "gelu_pytorch_tanh")
        if activation not in _ACTIVATIONS:
            raise _refuse(path, "hidden_activation", f"{activation!r} (gelu_pytorch_tanh, silu)")
    else:
        activation = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if activation != "silu":
            raise _refuse(path, "hidden_act", f"{activation!r} (only silu, SwiGLU MLPs)")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        bos = raw.get("bos_token_id", tokenizer.bos_token_id)
        max_positions = int(raw.get("max_position_embeddings", 4096))
        window = _sliding_window(raw, model_type, layers)
        if window is not None and window >= max_positions:
            window = None
        fields = {
            "qkv_bias": model_type == "qwen2",
            "qk_norm": model_type in ("qwen3", "qwen3_moe"),
            **_gemma(raw, model_type, hidden),
        }
        return ModelConfig(
            name=path.name,
            architecture=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=_ACTIVATIONS[activation],
            sliding_window=window,
            layer_types=_layer_types(raw, model_type, layers) if window is not None else None,
            bos_token_id=_ids(bos)[0] if _ids(bos) else None,
            eos_token_ids=_eos_ids(raw, path, tokenizer),
            **fields,
            **_rope(raw, path, model_type),
            **_moe(raw, path, model_type, layers),
        )
    except ModelLoadError:
        raise
    except KeyError as err:
        raise ModelLoadError(f"{path / 'config.json'}: missing key {err}") from err
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{path / 'config.json'}: invalid value: {err}") from err


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{missing[0]}: shard listed in {_INDEX_FILE} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = [f.name for pattern in _PICKLE_GLOBS for f in path.glob(pattern)]
    if pickled:
        raise ModelLoadError(
            f"{path}: only pickled weights ({', '.join(sorted(pickled))}); they are refused "
            "because unpickling runs arbitrary code. Convert the checkpoint to safetensors."
        )
    raise ModelLoadError(f"{path}: no *.safetensors weight files")


def _weights_bytes(files: list[Path], dtype: torch.dtype) -> int:
    """Bytes the weights will take in `dtype`, from the safetensors headers alone."""
    size, total = torch.empty(0, dtype=dtype).element_size(), 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    numel = 1
                    for n in shard.get_slice(name).get_shape():
                        numel *= n
                    total += numel * size
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: unreadable safetensors file: {err}") from err
    return total


def _read_weights(
    files: list[Path],
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: bool,
) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(desc=f"loading {files[0].parent.name}", unit="tensor", disable=not progress)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue  # tied checkpoints sometimes store the copy too
                    tensor = shard.get_tensor(name)
                    if config.architecture in _GEMMA and name.endswith("norm.weight"):
                        tensor = 1.0 + tensor.float()  # Gemma's RMSNorm scales by (1 + w)
                    tensor = tensor.to(device=device, dtype=dtype)
                    name = _expert_name(name)
                    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                        weights.update(_split_experts(name, tensor, config))
                    else:
                        weights.update(_split_fused(name, tensor, config))
                    bar.update()
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: unreadable safetensors file: {err}") from err
    bar.close()
    return weights


def _expert_name(name: str) -> str:
    """Mixtral's MoE tensor names as Qwen3-MoE's (the names every loader gives)."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


def _split_experts(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict:
    """transformers 5's stacked experts (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) as one gate/up/down per expert; a misshapen one is left for check_weights."""
    prefix = name.rpartition("experts.")[0] + "experts."
    if tensor.dim() != 3 or tensor.shape[0] != config.num_experts:
        return {name: tensor}
    out = {}
    for e, part in enumerate(tensor):
        if name.endswith("gate_up_proj"):
            gate, up = part.chunk(2)
            out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        else:
            out[f"{prefix}{e}.down_proj.weight"] = part.contiguous()
    return out


def _split_fused(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """{name: tensor}, or a fused Phi-3 projection's parts under their own names."""
    prefix, _, rest = name.rpartition("layers.")
    layer, _, part = rest.partition(".")
    if part not in _FUSED:
        return {name: tensor}
    sizes = (
        (config.q_size, config.kv_size, config.kv_size)
        if part.startswith("self_attn")
        else (config.intermediate_size, config.intermediate_size)
    )
    if tensor.shape[0] != sum(sizes):
        return {name: tensor}  # check_weights names the unexpected tensor
    pieces = tensor.split(sizes)
    return {
        f"{prefix}layers.{layer}.{n}": p.contiguous()
        for n, p in zip(_FUSED[part], pieces, strict=True)
    }

"""Hugging Face checkpoint loader: `config.json` + safetensors (+ tokenizer) to HF-named weights.

Only safetensors are read, single-file or sharded with `model.safetensors.index.json`; pickled
checkpoints (`*.bin`, `*.pt`) are refused because unpickling runs arbitrary code. The family
named by `model_type` says, as data, which deltas to read (compute/models/families.py).
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
from compute.models.families import EVERY_LAYER, OPT_IN, PATTERN, Family, hf_family
from compute.tokenizer.tokenizer import Tokenizer
from kernels.log import get_logger

log = get_logger(__name__)

# transformers' activation names -> ModelConfig.hidden_act (each family takes those its
# record lists, compute/models/families.py).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATIONS = {ours: theirs for theirs, ours in _ACTIVATIONS.items()}
# Fused projections (Family.fused_projections: Phi-3), split at load into the names every
# loader gives.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}  # fmt: skip
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
_ROPE_KEYS = {  # each RoPE type's scaling keys -> ModelConfig fields
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_position",
    },
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
    family = _family(raw, path)
    config = _config(raw, path, family, tokenizer)
    check_fits(_weights_bytes(files, dtype), str(path))
    weights = _read_weights(files, config, family, dtype, device, progress)
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


def _family(raw: dict[str, Any], path: Path) -> Family:
    """The checkpoint's family (compute/models/families.py); an architecture headrace does not
    know, or a setting none of its families has, is refused."""
    try:
        family = hf_family(raw.get("model_type"), raw.get("architectures", []))
    except ValueError as err:
        raise ModelLoadError(f"{path / 'config.json'}: {err}") from err
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelLoadError(f"{path / 'config.json'}: o_proj/MLP biases are not supported")
    if raw.get("use_bidirectional_attention"):
        raise _refuse(path, "use_bidirectional_attention", "true (an encoder, not a decoder)")
    return family


def _refuse(path: Path, setting: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"{path / 'config.json'}: {setting}: {why}; headrace cannot serve it")


def _rope(raw: dict[str, Any], path: Path, family: Family) -> dict[str, Any]:
    """ModelConfig's RoPE fields; a RoPE setting headrace does not honour is refused."""
    params, local = _rope_parameters(raw, path, family)
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
        fields["rope_local_theta"] = float(local.get("rope_theta", family.local_rope_base))
    for key, field in _ROPE_KEYS[rope_type].items():
        if scaling.get(key) is None:
            raise _refuse(path, "rope_scaling", f"RoPE type {rope_type!r} without {key}")
        fields[field] = type(getattr(ModelConfig, field))(scaling[key])
    return fields


def _rope_parameters(
    raw: dict[str, Any], path: Path, family: Family
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RoPE settings of the full layers, and of the sliding layers when the family gives
    them their own base ({} otherwise)."""
    # transformers 5 nests RoPE settings under rope_parameters; 4.x kept them at the top level.
    params = raw.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if params and all(isinstance(v, dict) for v in params.values()):
        if family.local_rope_base is None or set(params) != {"full_attention", "sliding_attention"}:
            raise _refuse(path, "rope_parameters", f"per-layer-type RoPE ({', '.join(params)})")
        local, params = params["sliding_attention"], params["full_attention"]
    elif family.local_rope_base is not None:  # transformers 4.x
        local = {"rope_theta": raw.get("rope_local_base_freq", family.local_rope_base)}
    if local.get("rope_type", "default") != "default":
        raise _refuse(
            path, "rope_parameters", f"sliding layers' RoPE type {local['rope_type']!r} "
            "(only default)"
        )  # fmt: skip
    return params, local


def _sliding_window(raw: dict[str, Any], family: Family, num_layers: int) -> int | None:
    """The attention window of the model's sliding layers, or None when no layer slides."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:  # transformers 5 spells out each layer's kind
        return int(window) if "sliding_attention" in layer_types else None
    if family.window_layers != OPT_IN:
        return int(window)
    first = raw.get("max_window_layers", 0)
    return int(window) if raw.get("use_sliding_window") and first < num_layers else None


def _moe(raw: dict[str, Any], path: Path, family: Family, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields ({} for a dense model); router settings
    headrace does not honour are refused."""
    if family.experts is None:
        return {}
    for key, defaults in _ROUTER_SETTINGS.items():
        if raw.get(key) not in defaults:
            raise _refuse(path, key, f"{raw[key]!r} (only a softmax top-k router, no shared "
                          "experts)")  # fmt: skip
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    ffn, norm_key = int(raw[family.experts.width_key]), family.experts.norm_key
    norm = bool(raw.get(norm_key, False)) if norm_key else True  # else: always renormalised
    dense: tuple[int, ...] = ()  # every layer sparse unless the family names dense ones
    if family.experts.sparse_step:
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


def _layer_types(raw: dict[str, Any], family: Family, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention, "sliding" or "full", as transformers builds it."""
    names = raw.get("layer_types")
    if names is not None:
        return tuple("sliding" if t == "sliding_attention" else "full" for t in names)
    if family.window_layers == PATTERN:  # transformers 4.x: every n-th layer is full
        keys = family.hf_pattern_keys
        n = int(next((raw[key] for key in keys if key in raw), family.swa_pattern))
        return tuple("full" if (i + 1) % n == 0 else "sliding" for i in range(num_layers))
    if family.window_layers == EVERY_LAYER:
        return ("sliding",) * num_layers
    first = raw.get("max_window_layers", 0) if raw.get("use_sliding_window") else num_layers
    return tuple("sliding" if i >= first else "full" for i in range(num_layers))


def _deltas(raw: dict[str, Any], family: Family, hidden: int) -> dict[str, Any]:
    """ModelConfig's fields of the family's deltas from a Llama decoder (Gemma's deltas,
    compute/core/config.py: sqrt(hidden)-scaled embeddings, sandwich norms,
    query_pre_attn_scalar, soft-caps)."""
    fields: dict[str, Any] = {
        "qkv_bias": family.qkv_bias,
        "qk_norm": family.qk_norm,
        "sandwich_norms": family.sandwich_norms,
    }
    if family.embed_scale:
        fields["embed_scale"] = hidden**0.5
    if family.query_pre_attn_scalar:
        scalar = raw.get("query_pre_attn_scalar")
        fields["query_pre_attn_scalar"] = float(scalar) if scalar is not None else None
    if family.logit_softcaps:
        for key, field in (
            ("attn_logit_softcapping", "attn_logit_softcap"),
            ("final_logit_softcapping", "final_logit_softcap"),
        ):
            fields[field] = float(raw[key]) if raw.get(key) else None
    return fields


def _activation(raw: dict[str, Any], path: Path, family: Family) -> str:
    """ModelConfig.hidden_act; an activation the family's MLP does not take is refused."""
    key, default = family.activation_key, _HF_ACTIVATIONS[family.activations[0]]
    if key == "hidden_activation":  # Gemma; hidden_act is its legacy alias, null there
        activation = raw.get(key) or raw.get("hidden_act", default)
    else:
        activation = raw.get(key, raw.get("hidden_activation", default))
    if _ACTIVATIONS.get(activation) not in family.activations:
        supported = ", ".join(_HF_ACTIVATIONS[a] for a in family.activations)
        raise _refuse(path, key, f"{activation!r} (supported: {supported})")
    return _ACTIVATIONS[activation]


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


def _config(raw: dict[str, Any], path: Path, family: Family, tokenizer: Tokenizer) -> ModelConfig:
    activation = _activation(raw, path, family)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        bos = raw.get("bos_token_id", tokenizer.bos_token_id)
        max_positions = int(raw.get("max_position_embeddings", 4096))
        window = _sliding_window(raw, family, layers)
        if window is not None and window >= max_positions:
            window = None
        return ModelConfig(
            name=path.name,
            architecture=family.hf_model_type,
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
            hidden_act=activation,
            sliding_window=window,
            layer_types=_layer_types(raw, family, layers) if window is not None else None,
            bos_token_id=_ids(bos)[0] if _ids(bos) else None,
            eos_token_ids=_eos_ids(raw, path, tokenizer),
            **_deltas(raw, family, hidden),
            **_rope(raw, path, family),
            **_moe(raw, path, family, layers),
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
    family: Family,
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
                    if family.norm_plus_one and name.endswith("norm.weight"):
                        tensor = 1.0 + tensor.float()  # the RMSNorm scales by (1 + w)
                    tensor = tensor.to(device=device, dtype=dtype)
                    weights.update(_renamed(name, tensor, config, family))
                    bar.update()
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: unreadable safetensors file: {err}") from err
    bar.close()
    return weights


def _renamed(
    name: str, tensor: torch.Tensor, config: ModelConfig, family: Family
) -> dict[str, torch.Tensor]:
    """A stored tensor under the names every loader gives (compute/loaders/base.py): the
    family's renames (Mixtral's experts as Qwen3-MoE's), stacked experts and fused
    projections split."""
    for old, new in family.hf_renames:
        name = name.replace(old, new)
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return _split_experts(name, tensor, config)
    if family.fused_projections:
        return _split_fused(name, tensor, config)
    return {name: tensor}


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
    """{name: tensor}, or a fused projection's parts under their own names."""
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

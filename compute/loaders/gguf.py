"""GGUF loader: llama.cpp model files (the embedded default model is one) to HF-named weights.

Metadata gives the ModelConfig and the tokenizer; each tensor is renamed from llama.cpp's names
to HF Llama names and either dequantized with `gguf.quants.dequantize` (vectorised numpy, any
quantization the package supports) and cast to the requested dtype and device, or, when asked
(``quantized=True``) and its format is one the CPU kernels read (the format table,
kernels/cpu/quant.py ``FORMATS``), kept in its blocks as a kernels.cpu.quant.QuantizedWeight.
Matrices of any other quantized type load dequantized, named in one warning. The family named
by `general.architecture` says, as data, which deltas to read (compute/models/families.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from compute.core.config import ModelConfig
from compute.loaders.base import LoadedModel, ModelLoadError, check_weights
from compute.loaders.memory_check import check_fits
from compute.models.families import PATTERN, Family, gguf_family
from compute.tokenizer.gguf_vocab import gguf_field
from compute.tokenizer.tokenizer import Tokenizer
from kernels.cpu.quant import FORMATS, QuantizedWeight
from kernels.log import get_logger

log = get_logger(__name__)

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, split at load (_split_fused)
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router
    # The experts, stacked [E, rows, cols]: split per expert at load (_split_experts).
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")
# Sandwich norms (Family.sandwich_norms: Gemma): ffn_norm is the MLP's input norm, the other
# two the norms of the attention and MLP outputs.
_SANDWICH_NORM_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ RoPE scaling: llama.cpp's per-frequency divisors, read into the config.
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE (128k models): per-frequency factors for short and long contexts.
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# rope.scaling.type values headrace honours ("none" and linear; llama3 is rope_freqs).
_ROPE_SCALING_TYPES = ("none", "linear")
# GGUF block formats the CPU kernels compute with directly, by GGUF tensor type.
_KEPT_FORMATS = {f.ggml_type: name for name, f in FORMATS.items()}
# Types that are not block quantizations: these load as dense tensors in any mode.
_DENSE_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: bool = True,
    quantized: bool = False,
) -> LoadedModel:
    """Read a GGUF file: config and tokenizer from its metadata; weights dequantized, or
    (``quantized``) matrices of the formats in _KEPT_FORMATS kept in their blocks."""
    reader = _open(path)
    family = _family(reader, path)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except Exception as err:  # tokenizers reports bad vocabularies as plain Exception
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {err}") from err
    config = _config(reader, path, family, tokenizer)
    check_fits(_weights_bytes(reader, dtype, quantized), str(path))
    weights = _read_weights(reader, config, family, path, dtype, device, progress, quantized)
    check_weights(weights, config, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def _open(path: Path) -> gguf.GGUFReader:
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: empty file, not a GGUF model")
    try:
        return gguf.GGUFReader(path)
    # The reader fails on corrupt input with whatever numpy or struct raises, so take them all.
    except Exception as err:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (corrupt or truncated?): {err}"
        ) from err


def _family(reader: gguf.GGUFReader, path: Path) -> Family:
    """The file's family (compute/models/families.py), by its general.architecture."""
    try:
        return gguf_family(gguf_field(reader, "general.architecture"))
    except ValueError as err:
        raise ModelLoadError(f"{path}: {err}") from err


def _config(
    reader: gguf.GGUFReader, path: Path, family: Family, tokenizer: Tokenizer
) -> ModelConfig:
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
    arch = family.gguf_architecture
    hidden = _required(reader, path, f"{arch}.embedding_length")
    num_heads = _required(reader, path, f"{arch}.attention.head_count")
    head_dim = gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads)
    max_positions = gguf_field(reader, f"{arch}.context_length", 4096)
    num_layers = _required(reader, path, f"{arch}.block_count")
    try:
        return ModelConfig(
            name=path.name.removesuffix(".gguf"),
            architecture=arch,
            vocab_size=int(names["token_embd.weight"].shape[1]),  # ggml order: [hidden, vocab]
            hidden_size=hidden,
            intermediate_size=_required(reader, path, f"{arch}.feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rope_theta=_f32(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=_f32(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=max_positions,
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            **_window(reader, family, max_positions, num_layers),
            **_deltas(reader, path, family, hidden, num_layers),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            **_rope(reader, path, arch, head_dim, names),
            **_moe(reader, path, arch, names),
        )
    except ValueError as err:
        raise ModelLoadError(f"{path}: inconsistent metadata: {err}") from err


def _deltas(
    reader: gguf.GGUFReader, path: Path, family: Family, hidden: int, layers: int
) -> dict[str, Any]:
    """ModelConfig's fields of the family's deltas as llama.cpp reads them (Gemma's: its
    converter has folded the (1 + w) into the norms); q/k biases and norms are read from the
    file's tensors."""
    arch = family.gguf_architecture
    fields: dict[str, Any] = {
        "hidden_act": family.activations[0],
        "sandwich_norms": family.sandwich_norms,
    }
    if family.embed_scale:
        fields["embed_scale"] = hidden**0.5
    if family.logit_softcaps:
        for key, field in (
            ("attn_logit_softcapping", "attn_logit_softcap"),
            ("final_logit_softcapping", "final_logit_softcap"),
        ):
            cap = gguf_field(reader, f"{arch}.{key}")
            fields[field] = _f32(cap) if cap else None
    # llama.cpp scales by head_dim ** -0.5, but by (hidden / heads) ** -0.5 on the 27B
    # models (their query_pre_attn_scalar), which it recognises by their layer count.
    if layers == family.gguf_scalar_layers:
        heads = _required(reader, path, f"{arch}.attention.head_count")
        fields["query_pre_attn_scalar"] = float(hidden // heads)
    return fields


def _window(
    reader: gguf.GGUFReader, family: Family, max_positions: int, layers: int
) -> dict[str, Any]:
    """ModelConfig's sliding-window fields: the window (none when it spans the context) and,
    for a family whose sliding and full layers alternate, each layer's kind and the sliding
    layers' RoPE base (for the others the window applies to every layer)."""
    arch = family.gguf_architecture
    window = gguf_field(reader, f"{arch}.attention.sliding_window")
    fields: dict[str, Any] = {
        "sliding_window": int(window) if window and window < max_positions else None
    }
    if fields["sliding_window"] is None or family.window_layers != PATTERN:
        return fields
    pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        fields["layer_types"] = tuple("sliding" if p else "full" for p in pattern)
    else:
        # llama.cpp's pattern when the file lists none (llama-hparams set_swa_pattern).
        n = int(pattern or family.swa_pattern)
        fields["layer_types"] = tuple("sliding" if i % n < n - 1 else "full" for i in range(layers))
    if family.local_rope_base is not None:
        base = gguf_field(reader, f"{arch}.rope.freq_base_swa", family.local_rope_base)
        fields["rope_local_theta"] = _f32(base)
    return fields


def _rope(
    reader: gguf.GGUFReader, path: Path, arch: str, head_dim: int, names: dict[str, Any]
) -> dict[str, Any]:
    """ModelConfig's RoPE fields; RoPE metadata headrace does not honour is refused."""
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING_TYPES:
        supported = ", ".join(_ROPE_SCALING_TYPES)
        raise ModelLoadError(
            f"{path}: {arch}.rope.scaling.type: {scaling!r} is not supported (supported: "
            f"{supported}, and llama3 as a rope_freqs tensor); headrace cannot serve it"
        )
    longrope = sorted(n for n in names if n in _LONGROPE_TENSORS)
    if longrope:
        raise ModelLoadError(
            f"{path}: {', '.join(longrope)}: LongRoPE scaling (Phi-3 128k) is not supported; "
            "headrace cannot serve it"
        )
    dims = gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if dims != head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count: RoPE on {dims} of {head_dim} dims (partial "
            "rotary) is not supported; headrace cannot serve it"
        )
    fields: dict[str, Any] = {}
    if scaling == "linear":
        factor = _f32(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        fields.update(rope_type="linear", rope_factor=factor)
    if _ROPE_FREQS in names:
        factors = _dequantize(names[_ROPE_FREQS], path).reshape(-1)
        fields["rope_freq_factors"] = tuple(float(f) for f in factors)
    return fields


def _moe(reader: gguf.GGUFReader, path: Path, arch: str, names: dict[str, Any]) -> dict:
    """ModelConfig's mixture-of-experts fields ({} for a dense file). Expert tensors without
    the expert metadata are refused: such a file is never served as a dense model."""
    experts = int(gguf_field(reader, f"{arch}.expert_count", 0) or 0)
    carrying = sorted(n for n in names if n.split(".")[-2] in _EXPERT_TENSORS)
    if not experts:
        if carrying:
            raise ModelLoadError(
                f"{path}: expert tensors ({carrying[0]}, ...) without {arch}.expert_count: a "
                "mixture of experts without its metadata; headrace cannot serve it"
            )
        return {}
    if not any(n.endswith(".ffn_gate_inp.weight") for n in names):
        raise ModelLoadError(
            f"{path}: {arch}.expert_count: {experts} experts but no expert tensors "
            "(ffn_gate_inp, ffn_*_exps); headrace cannot serve it"
        )
    used = _required(reader, path, f"{arch}.expert_used_count")
    ffn_key = f"{arch}.expert_feed_forward_length"
    ffn = gguf_field(reader, ffn_key) or _required(reader, path, f"{arch}.feed_forward_length")
    layers = _required(reader, path, f"{arch}.block_count")
    # llama.cpp renormalises the top-k weights of every family served here (Mixtral's
    # `llama`, qwen3moe) unless the file says otherwise.
    norm = bool(gguf_field(reader, f"{arch}.expert_weights_norm", True))
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(ffn),
        "norm_topk_prob": norm,
        "dense_layers": dense,
    }


def _required(reader: gguf.GGUFReader, path: Path, key: str) -> int:
    value = gguf_field(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: missing metadata key {key}")
    return int(value)


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; keep the short form."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, sandwich_norms: bool = False) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    names = {**_BLOCK_NAMES, **_SANDWICH_NORM_NAMES} if sandwich_norms else _BLOCK_NAMES
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute(weight: torch.Tensor | QuantizedWeight, num_heads: int):
    """Undo convert_hf_to_gguf's `permute`, which regroups each head's rows from HF's
    rotate_half order (first half, second half) into llama.cpp's interleaved pairs."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2)
    order = order.reshape(-1)
    if isinstance(weight, QuantizedWeight):
        return weight.take_rows(order)  # whole rows of blocks move, codes untouched
    return weight[order].contiguous()


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    try:
        # A plain ndarray view: numpy.memmap slicing overhead dominates dequantizing otherwise.
        array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        array = array.reshape(shape)
    except (ValueError, NotImplementedError, TypeError) as err:
        raise ModelLoadError(
            f"{path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {err}"
        ) from err
    # F32 tensors come back as read-only views of the memory-mapped file.
    return array if array.flags.writeable else array.copy()


def _kept(tensor: Any) -> QuantizedWeight:
    """The tensor's blocks; a stacked [E, rows, cols] one as E * rows rows."""
    cols = int(tensor.shape[0])  # ggml lists dims innermost first
    rows = int(np.prod([int(n) for n in tensor.shape[1:]]))
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(rows, -1)
    return QuantizedWeight.from_gguf(_KEPT_FORMATS[tensor.tensor_type], blocks, cols)


def _keeps(tensor: Any, name: str | None, quantized: bool) -> bool:
    """Whether the loader keeps this tensor in its blocks (else: dense)."""
    matrix = len(tensor.shape) == 2 or ".mlp.experts." in (name or "")  # experts: 3-D
    return quantized and tensor.tensor_type in _KEPT_FORMATS and matrix


def _weights_bytes(reader: gguf.GGUFReader, dtype: torch.dtype, quantized: bool) -> int:
    """Bytes the loaded weights will take: kept blocks as in the file, the rest in dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(
        int(t.n_bytes) if _keeps(t, _hf_name(t.name), quantized) else int(t.n_elements) * size
        for t in reader.tensors
    )


def _read_weights(
    reader: gguf.GGUFReader,
    config: ModelConfig,
    family: Family,
    path: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: bool,
    quantized: bool,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    unsupported: dict[str, list[str]] = {}  # quantized type -> tensors dequantized anyway
    bar = tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress)
    for tensor in bar:
        name = _hf_name(tensor.name, family.sandwich_norms)
        if name is None:
            if tensor.name == _ROPE_FREQS:
                continue  # in the config (_rope)
            raise ModelLoadError(
                f"{path}: unexpected tensor {tensor.name} (a {config.architecture} feature "
                "headrace does not support?)"
            )
        keep = _keeps(tensor, name, quantized)
        if quantized and not keep and tensor.tensor_type not in _DENSE_TYPES:
            unsupported.setdefault(tensor.tensor_type.name, []).append(tensor.name)
        weight = _kept(tensor) if keep else torch.from_numpy(_dequantize(tensor, path))
        for part, piece in _pieces(name, weight, config, family).items():
            weights[part] = piece if keep else piece.to(device=device, dtype=dtype)
    if unsupported:
        log.warning(
            "no CPU kernel for these quantized types: tensors dequantized to dense",
            path=str(path),
            tensors={kind: ", ".join(names) for kind, names in unsupported.items()},
        )
    return weights


def _pieces(name: str, weight: Any, config: ModelConfig, family: Family) -> dict[str, Any]:
    """A file's tensor as the weights every loader gives: Q/K rows back in HF's order (the
    family's converter permuted them), stacked experts and fused projections split."""
    if family.permuted_qk and ".q_proj." in name:
        weight = _unpermute(weight, config.num_heads)
    elif family.permuted_qk and ".k_proj." in name:
        weight = _unpermute(weight, config.num_kv_heads)
    if ".mlp.experts." in name:
        return _split_experts(name, weight, config)
    if family.fused_projections:
        return _split_fused(name, weight, config)
    return {name: weight}


def _split_experts(name: str, weight: Any, config: ModelConfig) -> dict[str, Any]:
    """A stacked expert tensor (ffn_{gate,up,down}_exps: [E, rows, cols], kept blocks as
    E * rows rows) as one weight per expert, views of it: model.layers.N.mlp.experts.E.*."""
    prefix, _, part = name.rpartition("experts.")
    experts = config.num_experts
    if isinstance(weight, QuantizedWeight):
        rows = weight.rows // max(experts, 1)
        if not experts or weight.rows != experts * rows:
            return {name: weight}  # check_weights names it
        pieces = [
            QuantizedWeight(
                weight.format, weight.data[e * rows : (e + 1) * rows], rows, weight.cols
            )
            for e in range(experts)
        ]
    else:
        if weight.dim() != 3 or weight.shape[0] != experts:
            return {name: weight}
        pieces = list(weight)
    return {f"{prefix}experts.{e}.{part}": piece for e, piece in enumerate(pieces)}


def _split_fused(name: str, weight: Any, config: ModelConfig) -> dict[str, Any]:
    """{name: weight}, or a fused q|k|v (attn_qkv) or gate|up (ffn_up, twice the usual rows:
    Family.fused_projections, Phi-3) as the separate projections every loader gives."""
    attn = name.endswith(".self_attn.qkv_proj.weight")
    mlp = name.endswith(".mlp.up_proj.weight")
    if attn:
        parts = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
        prefix = name.removesuffix("qkv_proj.weight")
    elif mlp:
        parts = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        prefix = name.removesuffix("up_proj.weight")
    else:
        return {name: weight}
    if weight.shape[0] != sum(parts.values()):
        return {name: weight}  # check_weights names the misshapen tensor
    out, start = {}, 0
    for part, rows in parts.items():
        index = torch.arange(start, start + rows)
        piece = weight.take_rows(index) if isinstance(weight, QuantizedWeight) else weight[index]
        out[f"{prefix}{part}.weight"] = piece
        start += rows
    return out

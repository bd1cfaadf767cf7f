"""Launcher of the fused decoder (kernels/csrc/cpu/decoder.cpp): every decoder layer of a
step in one call.

The C++ side reads named structs, mirrored here field for field as ctypes Structures (the
order is the ABI; tests/kernels/test_cpu_decoder_abi.py checks every size and offset
against the library's): a ``LayerRow`` per layer (its weights, norms, caches and deltas),
built once per set of caches by ``decoder_table``; one ``DecoderStatics`` of what does not
change from step to step (sizes, eps, scale, RoPE tables, activation, soft-cap), built
beside it by ``decoder_statics``; and, per step, an ``AttentionStep`` (the attention
metadata's pointers) and a ``DecoderScratch`` (the buffers the layers pass between them).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kernels import reference
from kernels.cpu.attention import KV_DTYPE_CODES, check_attention, check_caches, check_rope
from kernels.cpu.library import check_tensor, library
from kernels.cpu.moe import moe_scratch, moe_shape
from kernels.metadata import AttentionMetadata

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _address(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class ProjectionRow(ctypes.Structure):
    """One projection of a layer: its weight's blocks, their block format (the kernels'
    code, kernels/cpu/quant.py), its output rows, its bias (0: none)."""

    _fields_ = (("weight", _P), ("format", _I), ("rows", _I), ("bias", _P))


class MoeRow(ctypes.Structure):
    """A mixture-of-experts MLP (router 0: the layer's MLP is dense, from gate_up and down):
    the router [E, H], E, top_k, whether the top k are renormalised, the experts' table
    (kernels/cpu/moe.py moe_table), the experts' intermediate size, and the int64 the
    number of experts run is added to."""

    _fields_ = (
        ("router", _P), ("experts", _I), ("top_k", _I), ("normalize", _I), ("table", _P),
        ("inter", _I), ("runs", _P),
    )  # fmt: skip


class LayerRow(ctypes.Structure):
    """A layer: the four projections, the post-attention norm, the next layer's input norm
    (the final norm after the last layer), its key and value caches, its sliding window
    (0: none), its per-head q and k norms (Qwen3, Gemma 3; 0: none), Gemma's norms of the
    attention and MLP outputs (0: none), its own RoPE tables (Gemma 3's sliding layers; 0:
    the statics'), and its mixture-of-experts MLP."""

    _fields_ = (
        ("qkv", ProjectionRow), ("o_proj", ProjectionRow), ("gate_up", ProjectionRow),
        ("down", ProjectionRow), ("post_norm", _P), ("next_norm", _P), ("key_cache", _P),
        ("value_cache", _P), ("window", _I), ("q_norm", _P), ("k_norm", _P),
        ("attn_out_norm", _P), ("mlp_out_norm", _P), ("cos", _P), ("sin", _P), ("moe", MoeRow),
    )  # fmt: skip


class DecoderStatics(ctypes.Structure):
    """What every step of a model passes alike: the layer count, hidden size, heads, KV
    heads, head dim, the dense layers' intermediate size, int8 activations, tanh-GELU
    (else SiLU), the caches' KV dtype code and block size, the RoPE tables, RMSNorm's eps,
    the attention scale and soft-cap (0: none)."""

    _fields_ = (
        ("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("dim", _I),
        ("inter", _I), ("int8", _I), ("gelu", _I), ("kv_dtype", _I), ("block_size", _I),
        ("cos", _P), ("sin", _P), ("eps", _F), ("scale", _F), ("softcap", _F),
    )  # fmt: skip
    # Beside the C fields, what the launcher needs (decoder_statics sets them): the RoPE
    # tables behind cos and sin, the first layer's caches (for the checks), the MoE layers'
    # moe_shape (None: none; it sizes their scratch).
    rope: tuple[Tensor, Tensor] = ()
    caches: tuple[Tensor, Tensor] = ()
    moe: tuple[int, int, int] | None = None


class AttentionStep(ctypes.Structure):
    """A step's attention metadata (kernels/metadata.py), as hr_paged_attention takes it."""

    _fields_ = (
        ("slot_mapping", _P), ("block_tables", _P), ("context_lens", _P), ("query_start", _P),
        ("num_seqs", _I), ("table_width", _I),
    )  # fmt: skip


class DecoderScratch(ctypes.Structure):
    """A step's buffers: qkv [T, (heads + 2 kv_heads) dim], q and attn [T, heads dim], tmp
    [T, H], gate_up [T, 2 I], act [T, I], and the MoE layers' float and int64 scratch
    (hr_moe_scratch_size; 0 without them)."""

    _fields_ = (
        ("qkv", _P), ("q", _P), ("attn", _P), ("tmp", _P), ("gate_up", _P), ("act", _P),
        ("moe", _P), ("moe_int", _P),
    )  # fmt: skip


# The structs in the order hr_decoder_abi reports their sizes and offsets.
ABI_STRUCTS = (ProjectionRow, MoeRow, LayerRow, DecoderStatics, AttentionStep, DecoderScratch)


def decoder_table(
    layers: list,
    final_norm: Tensor,
    kv_caches: list,
    local_rope: tuple[Tensor, Tensor] | None = None,
) -> ctypes.Array:
    """The LayerRow per layer hr_decoder_layers reads (a ctypes array).

    ``layers``: compute.models.decoder.LayerWeights whose projections are all quantized, in
    the layout their kernel reads, and whose experts have a table (compute/models/moe.py;
    checked here, once per table, not per step); ``local_rope``: the (cos, sin) of the
    layers marked ``local_rope``."""
    norms = [layer.input_norm for layer in layers[1:]] + [final_norm]
    rows = [
        _layer_row(layer, next_norm, caches, kv_caches[0][0].dtype, local_rope)
        for layer, next_norm, caches in zip(layers, norms, kv_caches, strict=True)
    ]
    if len({s for s in map(moe_shape, layers) if s is not None}) > 1:
        raise ValueError("layers: every mixture-of-experts layer must have one shape")
    return (LayerRow * len(rows))(*rows)


def _layer_row(layer, next_norm: Tensor, caches: tuple, kv_dtype, local_rope) -> LayerRow:
    """A layer's LayerRow, its tensors checked (in the order of its fields)."""
    key_cache, value_cache = caches
    mlp = ("gate_up", "down") if layer.moe is None else ()  # else 0: no dense MLP
    row = LayerRow(**{name: _projection(getattr(layer, name)) for name in ("qkv", "o_proj", *mlp)})
    h = layer.qkv.quantized.cols
    for name, t in (("post_norm", layer.post_norm), ("next_norm", next_norm)):
        check_tensor(name, t, torch.float32, (h,))
    if key_cache.dtype != kv_dtype:
        raise ValueError("kv_caches: every layer's caches must have one dtype")
    check_caches(key_cache, value_cache, (None, None, None, None))
    if (layer.q_norm is None) != (layer.k_norm is None):
        raise ValueError("layers: q and k norms come together")
    dim = None if layer.q_norm is None else layer.q_norm.shape[0]
    for name, size in (("q_norm", dim), ("k_norm", dim), ("attn_out_norm", h), ("mlp_out_norm", h)):
        t = getattr(layer, name)
        if t is not None:
            check_tensor(name, t, torch.float32, (size,))
        setattr(row, name, _address(t))
    if layer.local_rope:
        row.cos, row.sin = _local_rope(local_rope)
    row.post_norm, row.next_norm = layer.post_norm.data_ptr(), next_norm.data_ptr()
    row.key_cache, row.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
    row.window = layer.window or 0
    row.moe = _moe_row(layer.moe, layer.qkv.int8)
    return row


def _projection(projection) -> ProjectionRow:
    """``projection``: a compute.models.decoder.Projection."""
    weight, bias = projection.quantized, projection.bias
    if weight is None or weight.tiled_layout != projection.int8:
        raise ValueError("layers: every projection must be quantized, in its layout")
    if bias is not None:
        check_tensor("bias", bias, torch.float32, (weight.rows,))
    return ProjectionRow(weight.data.data_ptr(), weight.format.code, weight.rows, _address(bias))


def _local_rope(local_rope: tuple[Tensor, Tensor] | None) -> tuple[int, int]:
    if local_rope is None:
        raise ValueError("local_rope: a layer uses its own RoPE tables; pass them")
    cos, sin = local_rope
    check_tensor("local cos", cos, torch.float32, (None, None))
    check_tensor("local sin", sin, torch.float32, cos.shape)
    return cos.data_ptr(), sin.data_ptr()


def _moe_row(moe, int8: bool) -> MoeRow:
    """``moe``: a compute.models.moe.MoE or None (a dense MLP: all 0)."""
    if moe is None:
        return MoeRow()
    if moe.table is None or moe.int8 != int8:
        raise ValueError("layers: every expert must be quantized, in its layout (moe_table)")
    experts = moe.table.shape[0]
    check_tensor(
        "router", moe.router, torch.float32, (experts, moe.experts[0].gate_up.quantized.cols)
    )
    check_tensor("expert_runs", moe.runs, torch.int64, (1,))
    return MoeRow(
        moe.router.data_ptr(), experts, moe.top_k, int(moe.normalize), moe.table.data_ptr(),
        moe.inter, moe.runs.data_ptr(),
    )  # fmt: skip


def decoder_statics(
    layers: list,
    caches: tuple[Tensor, Tensor],
    rope: tuple[Tensor, Tensor],
    *,
    num_heads: int,
    eps: float,
    scale: float,
    gelu: bool = False,
    softcap: float | None = None,
) -> DecoderStatics:
    """The DecoderStatics of a decoder_table of ``layers``: ``caches``, the first layer's
    (every layer's have their shape and dtype: decoder_table); ``rope``, the (cos, sin)
    tables; ``gelu``, tanh-GELU (else SiLU); ``softcap``, the attention soft-cap. The
    sizes, the int8 numerics and the MoE shape are the layers' own."""
    key_cache, _ = caches
    cos, sin = rope
    head_dim = reference.kv_head_dim(key_cache)
    check_tensor("cos", cos, torch.float32, (None, head_dim))
    check_tensor("sin", sin, torch.float32, cos.shape)
    first, dense = layers[0], [layer for layer in layers if layer.moe is None]
    statics = DecoderStatics(
        num_layers=len(layers), hidden=first.qkv.quantized.cols, heads=num_heads,
        kv_heads=key_cache.shape[2], dim=head_dim,
        inter=dense[0].down.quantized.cols if dense else 0, int8=int(first.qkv.int8),
        gelu=int(gelu), kv_dtype=KV_DTYPE_CODES[key_cache.dtype], block_size=key_cache.shape[1],
        cos=cos.data_ptr(), sin=sin.data_ptr(), eps=eps, scale=scale, softcap=softcap or 0.0,
    )  # fmt: skip
    statics.rope, statics.caches = rope, caches
    statics.moe = next(filter(None, map(moe_shape, layers)), None)
    return statics


def decoder_layers(
    table: ctypes.Array,
    statics: DecoderStatics,
    x: Tensor,
    hidden: Tensor,
    positions: Tensor,
    meta: AttentionMetadata,
    check: bool = True,
) -> Tensor:
    """Every decoder layer in one call (kernels/csrc/cpu/decoder.cpp): x [T, H] is the first
    layer's normed input, hidden [T, H] the residual stream (updated in place); returns the
    output after the final norm. Bit-identical to the per-op launchers in the same order.

    ``table`` and ``statics``: decoder_table's and decoder_statics'. Needs every query row
    in a sequence (no padding)."""
    tokens = x.shape[0]
    q = torch.empty(tokens, statics.heads, statics.dim, dtype=torch.float32)
    if check:
        _check_step(table, statics, x, hidden, positions, meta, q)
    scratch, _buffers = _scratch(statics, tokens, q)  # the buffers live through the call
    step = AttentionStep(
        meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(), meta.context_lens.data_ptr(),
        meta.query_start_loc.data_ptr(), meta.num_seqs, meta.block_tables.shape[1],
    )  # fmt: skip
    if tokens:
        library().hr_decoder_layers(
            table, ctypes.byref(statics), x.data_ptr(), hidden.data_ptr(), tokens,
            positions.data_ptr(), ctypes.byref(step), ctypes.byref(scratch),
        )  # fmt: skip
    return x


def _check_step(
    table: ctypes.Array, statics: DecoderStatics, x: Tensor, hidden: Tensor,
    positions: Tensor, meta: AttentionMetadata, q: Tensor,
) -> None:  # fmt: skip
    tokens = x.shape[0]
    check_tensor("x", x, torch.float32, (tokens, statics.hidden))
    check_tensor("hidden", hidden, torch.float32, (tokens, statics.hidden))
    check_rope(tokens, positions, meta.slot_mapping, *statics.rope, statics.dim)
    if not isinstance(table, ctypes.Array) or table._type_ is not LayerRow:
        raise ValueError(f"table must be decoder_table's LayerRows, got {type(table).__name__}")
    if len(table) != statics.num_layers:
        raise ValueError(f"table: {len(table)} layers, the statics' {statics.num_layers}")
    check_attention(q, *statics.caches, meta)
    if sum(meta.query_lens) != tokens:
        raise ValueError("meta: every query row must belong to a sequence")


def _scratch(
    statics: DecoderStatics, tokens: int, q: Tensor
) -> tuple[DecoderScratch, list[Tensor]]:
    """A step's DecoderScratch, and the tensors it points into (q: the caller's)."""
    s, f32 = statics, torch.float32
    buffers = [
        torch.empty(tokens, (s.heads + 2 * s.kv_heads) * s.dim, dtype=f32), q,
        torch.empty(tokens, s.heads * s.dim, dtype=f32), torch.empty(tokens, s.hidden, dtype=f32),
        torch.empty(tokens, 2 * s.inter, dtype=f32), torch.empty(tokens, s.inter, dtype=f32),
    ]  # fmt: skip
    if s.moe:
        buffers += moe_scratch(tokens, s.hidden, s.moe)
    return DecoderScratch(*(t.data_ptr() for t in buffers)), buffers

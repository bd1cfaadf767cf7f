"""Launcher of the fused decoder (kernels/csrc/cpu/decoder.cpp): every decoder layer of a
step in one call, reading a table of the layers' weights, norms and caches."""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from kernels import reference
from kernels.cpu.attention import KV_DTYPE_CODES, check_attention, check_caches
from kernels.cpu.library import check_tensor, library
from kernels.cpu.moe import moe_scratch, moe_shape
from kernels.metadata import AttentionMetadata

# Fields per layer of decoder_table (kernels/csrc/cpu/decoder.cpp kLayerFields).
_LAYER_FIELDS = 36
# The MoE fields of a layer's row in that table (its last seven: router first), and those
# of them that make its moe_shape (experts, top_k, expert intermediate size).
_MOE_FIELDS = slice(29, 36)
_MOE_SHAPE_FIELDS = [30, 31, 34]


def decoder_table(
    layers: list,
    final_norm: Tensor,
    kv_caches: list,
    gelu: bool = False,
    softcap: float | None = None,
    local_rope: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The int64 table hr_decoder_layers reads: per layer the four projections (weight,
    block format, rows, bias or 0), post-attention norm, next input norm, K and V caches,
    sliding window (0 = none), per-head q and k norm weights (0 = none), then Gemma's
    deltas: attention- and MLP-output norms (0 = none), tanh-GELU (else SiLU), the
    attention soft-cap's float bits (0 = none), the RoPE (cos, sin) of the layers
    marked ``local_rope`` (Gemma 3's sliding layers; 0 = the call's tables), and a
    mixture-of-experts layer's MLP (_moe_fields; all 0 on a dense layer).

    ``layers``: compute.models.decoder.LayerWeights whose projections are all quantized, in the
    layout their kernel reads, and whose experts have a table (compute/models/moe.py; checked
    here, once per table, not per step)."""
    table = torch.zeros(len(layers), _LAYER_FIELDS, dtype=torch.int64)
    norms = [layer.input_norm for layer in layers[1:]] + [final_norm]
    for i, (layer, next_norm, (key_cache, value_cache)) in enumerate(
        zip(layers, norms, kv_caches, strict=True)
    ):
        row = []
        mlp = (layer.gate_up, layer.down) if layer.moe is None else ()
        for projection in (layer.qkv, layer.o_proj, *mlp):
            weight, bias = projection.quantized, projection.bias
            if weight is None or weight.tiled_layout != projection.int8:
                raise ValueError("layers: every projection must be quantized, in its layout")
            if bias is not None:
                check_tensor("bias", bias, torch.float32, (weight.rows,))
            bias_ptr = 0 if bias is None else bias.data_ptr()
            row += [weight.data.data_ptr(), weight.format.code, weight.rows, bias_ptr]
        row += [0] * 8 * (layer.moe is not None)  # no dense gate|up and down
        for name, t in (("post_norm", layer.post_norm), ("next_norm", next_norm)):
            check_tensor(name, t, torch.float32, (layer.qkv.quantized.cols,))
        if key_cache.dtype != kv_caches[0][0].dtype:
            raise ValueError("kv_caches: every layer's caches must have one dtype")
        check_caches(key_cache, value_cache, (None, None, None, None))
        row += [layer.post_norm.data_ptr(), next_norm.data_ptr()]
        row += [key_cache.data_ptr(), value_cache.data_ptr(), layer.window or 0]
        if (layer.q_norm is None) != (layer.k_norm is None):
            raise ValueError("layers: q and k norms come together")
        for name, t in (("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
            if t is not None:
                check_tensor(name, t, torch.float32, (layer.q_norm.shape[0],))
        row += [0 if t is None else t.data_ptr() for t in (layer.q_norm, layer.k_norm)]
        for name, t in (("attn_out_norm", layer.attn_out_norm),
                        ("mlp_out_norm", layer.mlp_out_norm)):  # fmt: skip
            if t is not None:
                check_tensor(name, t, torch.float32, (layer.qkv.quantized.cols,))
            row.append(0 if t is None else t.data_ptr())
        cap_bits = int.from_bytes(struct.pack("<f", softcap), "little") if softcap else 0
        row += [int(gelu), cap_bits]
        if layer.local_rope:
            if local_rope is None:
                raise ValueError("local_rope: a layer uses its own RoPE tables; pass them")
            cos, sin = local_rope
            check_tensor("local cos", cos, torch.float32, (None, None))
            check_tensor("local sin", sin, torch.float32, cos.shape)
            row += [cos.data_ptr(), sin.data_ptr()]
        else:
            row += [0, 0]
        row += _moe_fields(layer.moe, layer.qkv.int8)
        table[i] = torch.tensor(row, dtype=torch.int64)
    if len({s for s in map(moe_shape, layers) if s is not None}) > 1:
        raise ValueError("layers: every mixture-of-experts layer must have one shape")
    return table


def _moe_fields(moe, int8: bool) -> list[int]:
    """A layer's MoE fields of decoder_table: router [E, H] pointer, E, top_k, normalize,
    experts' table pointer, expert intermediate size, its run counter's pointer (0s: no
    MoE). ``moe``: a compute.models.moe.MoE or None."""
    if moe is None:
        return [0] * (_MOE_FIELDS.stop - _MOE_FIELDS.start)
    if moe.table is None or moe.int8 != int8:
        raise ValueError("layers: every expert must be quantized, in its layout (moe_table)")
    experts = moe.table.shape[0]
    check_tensor(
        "router", moe.router, torch.float32, (experts, moe.experts[0].gate_up.quantized.cols)
    )
    check_tensor("expert_runs", moe.runs, torch.int64, (1,))
    return [
        moe.router.data_ptr(), experts, moe.top_k, int(moe.normalize), moe.table.data_ptr(),
        moe.inter, moe.runs.data_ptr(),
    ]  # fmt: skip


def decoder_layers(
    table: Tensor,
    int8: bool,
    x: Tensor,
    hidden: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    intermediate: int,
    eps: float,
    scale: float,
    check: bool = True,
    moe: tuple[int, int, int] | None = None,
) -> Tensor:
    """Every decoder layer in one call (kernels/csrc/cpu/decoder.cpp): x [T, H] is the first
    layer's normed input, hidden [T, H] the residual stream (updated in place); returns the
    output after the final norm. Bit-identical to the per-op launchers in the same order.

    ``key_cache``/``value_cache``: the first layer's, for the checks (every layer's cache
    has their shape: decoder_table). Needs every query row in a sequence (no padding).
    ``intermediate``: the dense layers' MLP size; ``moe``: the MoE layers' moe_shape (None:
    none)."""
    tokens, h = x.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    head_dim = reference.kv_head_dim(key_cache)
    q = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    if check:
        check_tensor("x", x, torch.float32, (tokens, h))
        check_tensor("hidden", hidden, torch.float32, (tokens, h))
        check_tensor("positions", positions, torch.int64, (tokens,))
        check_tensor("slot_mapping", meta.slot_mapping, torch.int64, (tokens,))
        check_tensor("cos", cos, torch.float32, (None, head_dim))
        check_tensor("sin", sin, torch.float32, cos.shape)
        check_tensor("table", table, torch.int64, (None, _LAYER_FIELDS))
        check_attention(q, key_cache, value_cache, meta)
        if sum(meta.query_lens) != tokens:
            raise ValueError("meta: every query row must belong to a sequence")
        if tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
            raise ValueError(f"positions must be in [0, {cos.shape[0]})")
        moe_rows = table[:, _MOE_FIELDS.start] != 0
        shapes = {tuple(r) for r in table[moe_rows][:, _MOE_SHAPE_FIELDS].tolist()}
        if shapes != ({moe} if moe else set()):
            raise ValueError(f"moe: the table's MoE layers are {shapes or 'none'}, not {moe}")
    qkv = torch.empty(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32)
    attn = torch.empty(tokens, num_heads * head_dim, dtype=torch.float32)
    tmp = torch.empty(tokens, h, dtype=torch.float32)
    gate_up = torch.empty(tokens, 2 * intermediate, dtype=torch.float32)
    act = torch.empty(tokens, intermediate, dtype=torch.float32)
    scratch, int_scratch = moe_scratch(tokens, h, moe) if moe else (None, None)
    if tokens:
        library().hr_decoder_layers(
            table.data_ptr(), table.shape[0], int(int8), x.data_ptr(), hidden.data_ptr(),
            tokens, h, num_heads, num_kv_heads, head_dim, intermediate, eps,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
            meta.block_tables.data_ptr(), meta.context_lens.data_ptr(),
            meta.query_start_loc.data_ptr(), meta.num_seqs, block_size,
            meta.block_tables.shape[1], scale,
            qkv.data_ptr(), q.data_ptr(), attn.data_ptr(), tmp.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), KV_DTYPE_CODES[key_cache.dtype],
            *(None if t is None else t.data_ptr() for t in (scratch, int_scratch)),
        )  # fmt: skip
    return x

"""Launchers of the CPU kernels (kernels/csrc/cpu/): build once, load, check, call.

The library is built by kernels/cpu/build.py and called through ctypes with plain
pointers, so it needs no torch headers. Each launcher checks dtypes, shapes and
contiguity (ValueError naming the argument) before a pointer crosses; the kernels
trust them. ``available()`` says whether this machine can run them at all.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch
from torch import Tensor

from kernels import reference
from kernels.cpu import build as cpu_build
from kernels.cpu.quant import QuantizedWeight
from kernels.log import get_logger
from kernels.metadata import AttentionMetadata

log = get_logger(__name__)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "hr_quant_linear": (_I, _P, _I, _I, _P, _I, _P, _P),
    "hr_quant_linear_int8": (_I, _P, _I, _I, _P, _I, _P, _P),
    "hr_quant_linear_int8_tile16": (_I, _P, _I, _I, _P, _I, _P, _P),  # a test's check
    "hr_dequantize_rows": (_I, _P, _I, _P, _I, _P),
    "hr_dequantize_tiled": (_I, _P, _I, _P, _I, _P),
    "hr_rms_norm": (_P, _P, _P, _I, _I, _F),
    "hr_add_rms_norm": (_P, _P, _P, _P, _I, _I, _F),
    "hr_head_rms_norm": (_P, _P, _I, _I, _I, _I, _F),
    "hr_silu_mul": (_P, _P, _I, _I),
    "hr_gelu_tanh_mul": (_P, _P, _I, _I),
    "hr_paged_attention": (_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, _F),
    "hr_rope_and_cache": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I),
    "hr_set_num_threads": (_I,),
    "hr_argmax_rows": (_P, _I, _I, _P),
    # tokens, h, inter, top_k, experts, sizes out
    "hr_moe_scratch_size": (_I, _I, _I, _I, _I, _P),
    # router, experts, x, tokens, h, top_k, normalize, probs scratch, ids, weights
    "hr_moe_route": (_P, _I, _P, _I, _I, _I, _I, _P, _P, _P),
    # table, experts, int8, x, tokens, h, inter, top_k, ids, weights, out, scratch, runs
    "hr_moe_experts": (_P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P),
    # router, experts, top_k, normalize, table, int8, x, tokens, h, inter, out, scratch, runs
    "hr_moe": (_P, _I, _I, _I, _P, _I, _P, _I, _I, _I, _P, _P, _P, _P),
    # layers .. eps, positions .. scale, six scratch buffers, the KV dtype, MoE scratch
    "hr_decoder_layers": (_P, _I, _I, _P, _P, *[_I] * 6, _F, *[_P] * 7, _I, _I, _I, _F)
    + (*[_P] * 6, _I, _P, _P),
}
# The KV cache dtypes the kernels read and write (kernels/csrc/cpu/common.h KvDtype): K and
# V are rounded to the cache dtype once, when written, and widened to fp32 when read. An
# int8 cache row is head_dim codes carrying their own bf16 scale (kernels/reference.py
# quantize_kv_rows).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
# Fields per layer of decoder_table (kernels/csrc/cpu/decoder.cpp kLayerFields).
_LAYER_FIELDS = 36
# The MoE fields of a layer's row in that table (its last seven: router first), and those
# of them that make its moe_shape (experts, top_k, expert intermediate size).
_MOE_FIELDS = slice(29, 36)
_MOE_SHAPE_FIELDS = [30, 31, 34]


@functools.cache
def _load() -> ctypes.CDLL | Exception:
    """The kernels for this CPU, built first if needed; or why they cannot be (once per
    process: a failed build is not retried at every call)."""
    try:
        isa = cpu_build.best_isa()
        if isa is None:
            raise cpu_build.BuildError("this CPU has neither AVX-512 nor AVX2")
        path = cpu_build.build(isa)
        lib = ctypes.CDLL(str(path))
    except (cpu_build.BuildError, OSError) as err:
        return err
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    log.info("cpu kernels loaded", isa=isa, path=str(path))
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernels; BuildError (or OSError) when this machine cannot have them."""
    lib = _load()
    if isinstance(lib, Exception):
        raise lib
    return lib


def available() -> bool:
    """True when the kernels build and load here; logs why not otherwise."""
    lib = _load()
    if isinstance(lib, Exception):
        log.warning("cpu kernels unavailable", reason=str(lib).splitlines()[0])
        return False
    return True


def use_torch_threads() -> None:
    """Run the kernels called from this thread on torch's thread count (OpenMP keeps one
    count per calling thread, and the step loop is not the thread that set torch's)."""
    library().hr_set_num_threads(torch.get_num_threads())


def _check(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int | None, ...]) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    if len(shape) != t.dim() or any(
        s is not None and s != n for s, n in zip(shape, t.shape, strict=True)
    ):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def quant_linear(
    x: Tensor,
    weight: QuantizedWeight,
    bias: Tensor | None = None,
    int8: bool = False,
    check: bool = True,
) -> Tensor:
    """x [n, cols] fp32 @ weight.T (+ bias) -> [n, rows] fp32.

    ``int8``: x is quantized to int8 per block of 32 first (quantize_activations) and the
    products are integer dot products, as llama.cpp computes (the weight must be in the
    tiled layout, ``weight.tiled()``); otherwise exact fp32 math (the per-row layout)."""
    if check:
        _check("x", x, torch.float32, (None, weight.cols))
        if weight.tiled_layout != int8:
            layout = "tiled (weight.tiled())" if int8 else "per-row"
            raise ValueError(
                f"weight: the {'int8' if int8 else 'fp32'} kernel reads the {layout} layout"
            )
        if bias is not None:
            _check("bias", bias, torch.float32, (weight.rows,))
    out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
    if x.shape[0]:
        lib = library()
        fn = lib.hr_quant_linear_int8 if int8 else lib.hr_quant_linear
        fn(
            weight.format.code,
            x.data_ptr(),
            x.shape[0],
            weight.cols,
            weight.data.data_ptr(),
            weight.rows,
            out.data_ptr(),
            None if bias is None else bias.data_ptr(),
        )
    return out


def _check_caches(key_cache: Tensor, value_cache: Tensor, shape: tuple[int | None, ...]) -> int:
    """Both caches: contiguous CPU tensors of one KV dtype the kernels take, of ``shape``
    (its last entry the head dim: an int8 cache's rows are 4 bytes wider); returns the
    dtype's code."""
    code = KV_DTYPE_CODES.get(key_cache.dtype)
    if code is None:
        names = ", ".join(str(t).removeprefix("torch.") for t in KV_DTYPE_CODES)
        raise ValueError(
            f"key_cache: the CPU kernels take KV caches of {names}, got {key_cache.dtype}"
        )
    if shape[-1] is not None:
        shape = (*shape[:-1], reference.kv_row_width(shape[-1], key_cache.dtype))
    _check("key_cache", key_cache, key_cache.dtype, shape)
    _check("value_cache", value_cache, key_cache.dtype, key_cache.shape)
    return code


def check_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, meta: AttentionMetadata
) -> None:
    """What paged_attention needs of its arguments (ValueError naming the first that fails)."""
    tokens, num_heads, head_dim = query.shape
    num_blocks, _, num_kv_heads, _ = key_cache.shape
    _check("query", query, torch.float32, (tokens, num_heads, head_dim))
    _check_caches(key_cache, value_cache, (None, None, num_kv_heads, head_dim))
    _check("block_tables", meta.block_tables, torch.int32, (meta.num_seqs, None))
    _check("context_lens", meta.context_lens, torch.int32, (meta.num_seqs,))
    _check("query_start_loc", meta.query_start_loc, torch.int32, (meta.num_seqs + 1,))
    if head_dim % 16:
        raise ValueError(f"query: head dim must be a multiple of 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query: {num_heads} heads are not a multiple of {num_kv_heads} KV heads")
    if sum(meta.query_lens) > tokens:
        raise ValueError(f"meta: {sum(meta.query_lens)} queries for {tokens} query rows")
    if meta.num_seqs and int(meta.block_tables.max()) >= num_blocks:
        raise ValueError(f"block_tables: block ids must be < {num_blocks}")
    if meta.max_context_len > meta.block_tables.shape[1] * key_cache.shape[1]:
        raise ValueError("block_tables: a context is longer than its table")


def quantize_activations(x: Tensor) -> Tensor:
    """What ``quant_linear(int8=True)`` computes with instead of x [n, k] (torch reference):
    per block of 32, dx = max|x| / 127 and x ~ round(x / dx) * dx."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # A true division (a Python scalar over a tensor becomes reciprocal x 127 in torch,
    # an ulp away at times, enough to round a code the other way).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def dequantize_rows(weight: QuantizedWeight, rows: Tensor | None = None) -> Tensor:
    """fp32 copies of `rows` (int64 indices; None = all) of the weight, bit-exact."""
    if weight.parts:
        raise ValueError("weight: a stacked weight has no row kernel (dequantize() it)")
    count = weight.rows if rows is None else rows.shape[0]
    if rows is not None:
        _check("rows", rows, torch.int64, (None,))
        if count and (int(rows.min()) < 0 or int(rows.max()) >= weight.rows):
            raise ValueError(f"rows must be in [0, {weight.rows})")
    out = torch.empty(count, weight.cols, dtype=torch.float32)
    if count:
        lib = library()
        fn = lib.hr_dequantize_tiled if weight.tiled_layout else lib.hr_dequantize_rows
        fn(
            weight.format.code,
            weight.data.data_ptr(),
            weight.cols,
            None if rows is None else rows.data_ptr(),
            count,
            out.data_ptr(),
        )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, check: bool = True) -> Tensor:
    """RMSNorm of each row of x [n, h] (HF LlamaRMSNorm's order)."""
    n, h = x.shape
    if check:
        _check("x", x, torch.float32, (n, h))
        _check("weight", weight, torch.float32, (h,))
    out = torch.empty_like(x)
    library().hr_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n, h, eps)
    return out


def argmax_rows(x: Tensor) -> Tensor:
    """int64 [n]: each row's argmax of x [n, v] (float32), torch.argmax(x, -1)'s answer (the
    lowest of equal ids; a NaN counts as the largest) on every thread."""
    n, v = x.shape
    _check("x", x, torch.float32, (n, v))
    out = torch.empty(n, dtype=torch.int64)
    library().hr_argmax_rows(x.data_ptr(), n, v, out.data_ptr())
    return out


def head_rms_norm(
    qkv: Tensor, weight: Tensor, start: int, heads: int, eps: float, check: bool = True
) -> None:
    """In place: RMSNorm of each of the `heads` head slices that begin at column `start` of
    every row of the fused qkv [T, width], by weight [head_dim] (per-head q/k norms)."""
    tokens, width = qkv.shape
    dim = weight.shape[0]
    if check:
        _check("qkv", qkv, torch.float32, (tokens, width))
        _check("weight", weight, torch.float32, (dim,))
        if dim % 16 or start + heads * dim > width:
            raise ValueError(f"head_rms_norm: {heads} heads of {dim} from {start} in {width}")
    if tokens:
        library().hr_head_rms_norm(
            qkv.data_ptr() + 4 * start, weight.data_ptr(), tokens, width, heads, dim, eps
        )


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, check: bool = True
) -> Tensor:
    """residual += x (in place); returns RMSNorm(residual)."""
    n, h = residual.shape
    if check:
        _check("x", x, torch.float32, (n, h))
        _check("residual", residual, torch.float32, (n, h))
        _check("weight", weight, torch.float32, (h,))
    out = torch.empty_like(x)
    library().hr_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), n, h, eps
    )
    return out


def silu_mul(gate_up: Tensor, check: bool = True) -> Tensor:
    """gate_up [n, 2 * i] -> silu(gate) * up [n, i]."""
    return _gated(gate_up, "hr_silu_mul", check)


def gelu_tanh_mul(gate_up: Tensor, check: bool = True) -> Tensor:
    """gate_up [n, 2 * i] -> gelu_tanh(gate) * up [n, i] (Gemma's GeGLU)."""
    return _gated(gate_up, "hr_gelu_tanh_mul", check)


def _gated(gate_up: Tensor, kernel: str, check: bool) -> Tensor:
    n, width = gate_up.shape
    if check:
        _check("gate_up", gate_up, torch.float32, (n, width))
        if width % 32:
            raise ValueError(f"gate_up: width must be a multiple of 32, got {width}")
    out = torch.empty(n, width // 2, dtype=torch.float32)
    getattr(library(), kernel)(gate_up.data_ptr(), out.data_ptr(), n, width // 2)
    return out


def rope_and_cache(
    qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    num_heads: int,
    check: bool = True,
) -> Tensor:
    """Rotate q and k of the fused qkv [T, (H + 2 Hkv) D]; k, v into the caches; -> q [T, H, D].

    Positions must be < the tables' length: the launcher checks them (with ``check``)."""
    num_kv_heads, head_dim = key_cache.shape[2], reference.kv_head_dim(key_cache)
    tokens = qkv.shape[0]
    if check:
        _check("qkv", qkv, torch.float32, (tokens, (num_heads + 2 * num_kv_heads) * head_dim))
        _check("positions", positions, torch.int64, (tokens,))
        _check("slot_mapping", slot_mapping, torch.int64, (tokens,))
        _check("cos", cos, torch.float32, (None, head_dim))
        _check("sin", sin, torch.float32, cos.shape)
        _check_caches(key_cache, value_cache, (None, None, num_kv_heads, head_dim))
        if tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
            raise ValueError(f"positions must be in [0, {cos.shape[0]})")
    q = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    library().hr_rope_and_cache(
        qkv.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        KV_DTYPE_CODES[key_cache.dtype],
    )
    return q


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    check: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of query [T, H, D] over the paged caches (kernels/metadata.py's layout);
    ``window`` and ``softcap`` as kernels/reference.py paged_attention applies them."""
    tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if check:
        check_attention(query, key_cache, value_cache, meta)
    # Rows no sequence owns (batch padding) come back zero, as the reference gives them.
    covered = sum(meta.query_lens) == tokens
    out = torch.empty_like(query) if covered else torch.zeros_like(query)
    library().hr_paged_attention(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        meta.block_tables.data_ptr(),
        meta.context_lens.data_ptr(),
        meta.query_start_loc.data_ptr(),
        meta.num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        meta.block_tables.shape[1],
        scale,
        out.data_ptr(),
        KV_DTYPE_CODES[key_cache.dtype],
        window or 0,
        softcap or 0.0,
    )
    return out


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
                _check("bias", bias, torch.float32, (weight.rows,))
            bias_ptr = 0 if bias is None else bias.data_ptr()
            row += [weight.data.data_ptr(), weight.format.code, weight.rows, bias_ptr]
        row += [0] * 8 * (layer.moe is not None)  # no dense gate|up and down
        for name, t in (("post_norm", layer.post_norm), ("next_norm", next_norm)):
            _check(name, t, torch.float32, (layer.qkv.quantized.cols,))
        if key_cache.dtype != kv_caches[0][0].dtype:
            raise ValueError("kv_caches: every layer's caches must have one dtype")
        _check_caches(key_cache, value_cache, (None, None, None, None))
        row += [layer.post_norm.data_ptr(), next_norm.data_ptr()]
        row += [key_cache.data_ptr(), value_cache.data_ptr(), layer.window or 0]
        if (layer.q_norm is None) != (layer.k_norm is None):
            raise ValueError("layers: q and k norms come together")
        for name, t in (("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
            if t is not None:
                _check(name, t, torch.float32, (layer.q_norm.shape[0],))
        row += [0 if t is None else t.data_ptr() for t in (layer.q_norm, layer.k_norm)]
        for name, t in (("attn_out_norm", layer.attn_out_norm),
                        ("mlp_out_norm", layer.mlp_out_norm)):  # fmt: skip
            if t is not None:
                _check(name, t, torch.float32, (layer.qkv.quantized.cols,))
            row.append(0 if t is None else t.data_ptr())
        cap_bits = int.from_bytes(struct.pack("<f", softcap), "little") if softcap else 0
        row += [int(gelu), cap_bits]
        if layer.local_rope:
            if local_rope is None:
                raise ValueError("local_rope: a layer uses its own RoPE tables; pass them")
            cos, sin = local_rope
            _check("local cos", cos, torch.float32, (None, None))
            _check("local sin", sin, torch.float32, cos.shape)
            row += [cos.data_ptr(), sin.data_ptr()]
        else:
            row += [0, 0]
        row += _moe_fields(layer.moe, layer.qkv.int8)
        table[i] = torch.tensor(row, dtype=torch.int64)
    if len({s for s in map(moe_shape, layers) if s is not None}) > 1:
        raise ValueError("layers: every mixture-of-experts layer must have one shape")
    return table


def moe_shape(layer) -> tuple[int, int, int] | None:
    """(experts, top_k, expert intermediate size) of a layer's MoE MLP; None: dense."""
    moe = layer.moe
    return None if moe is None else (len(moe.experts), moe.top_k, moe.inter)


def _moe_fields(moe, int8: bool) -> list[int]:
    """A layer's MoE fields of decoder_table: router [E, H] pointer, E, top_k, normalize,
    experts' table pointer, expert intermediate size, its run counter's pointer (0s: no
    MoE). ``moe``: a compute.models.moe.MoE or None."""
    if moe is None:
        return [0] * (_MOE_FIELDS.stop - _MOE_FIELDS.start)
    if moe.table is None or moe.int8 != int8:
        raise ValueError("layers: every expert must be quantized, in its layout (moe_table)")
    experts = moe.table.shape[0]
    _check("router", moe.router, torch.float32, (experts, moe.experts[0].gate_up.quantized.cols))
    _check("expert_runs", moe.runs, torch.int64, (1,))
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
        _check("x", x, torch.float32, (tokens, h))
        _check("hidden", hidden, torch.float32, (tokens, h))
        _check("positions", positions, torch.int64, (tokens,))
        _check("slot_mapping", meta.slot_mapping, torch.int64, (tokens,))
        _check("cos", cos, torch.float32, (None, head_dim))
        _check("sin", sin, torch.float32, cos.shape)
        _check("table", table, torch.int64, (None, _LAYER_FIELDS))
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


def moe_table(experts: list) -> Tensor | None:
    """The int64 [E, 4] table hr_moe_experts reads (each expert's gate|up and down: block
    pointer, format), or None when some projection is not a single block format (dense,
    or a stack of formats): those run per op (compute/models/moe.py); None for no experts.

    ``experts``: compute.models.moe.Expert objects, their projections in their kernel's layout."""
    if not experts:
        return None
    rows = []
    for expert in experts:
        row = []
        for projection in (expert.gate_up, expert.down):
            weight = projection.quantized
            if weight is None or weight.parts or weight.tiled_layout != projection.int8:
                return None
            row += [weight.data.data_ptr(), weight.format.code]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def moe_scratch(tokens: int, h: int, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """The float and int64 scratch of the MoE kernels for ``tokens`` rows of hidden size
    ``h`` and moe_shape ``shape`` (kernels/csrc/cpu/moe.cpp hr_moe_scratch_size)."""
    experts, top_k, inter = shape
    sizes = (ctypes.c_int64 * 2)()
    library().hr_moe_scratch_size(tokens, h, inter, top_k, experts, sizes)
    return torch.empty(sizes[0], dtype=torch.float32), torch.empty(sizes[1], dtype=torch.int64)


def moe_route(
    router: Tensor, x: Tensor, top_k: int, normalize: bool, check: bool = True
) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) of each row of x [T, H]: softmax of
    the router logits x . router[e] ([E, H]), the top k (ties to the lower id), renormalised
    to sum to 1 when ``normalize`` (kernels/csrc/cpu/moe.cpp)."""
    tokens, h = x.shape
    experts = router.shape[0]
    if check:
        _check("x", x, torch.float32, (tokens, h))
        _check("router", router, torch.float32, (experts, h))
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    probs = torch.empty(tokens, experts, dtype=torch.float32)
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    library().hr_moe_route(
        router.data_ptr(), experts, x.data_ptr(), tokens, h, top_k, int(normalize),
        probs.data_ptr(), ids.data_ptr(), weights.data_ptr(),
    )  # fmt: skip
    return weights, ids


def moe(
    router: Tensor, table: Tensor, int8: bool, x: Tensor, top_k: int, normalize: bool,
    inter: int, runs: Tensor, check: bool = True,
) -> Tensor:  # fmt: skip
    """A mixture-of-experts MLP in one call: moe_route, then moe_experts (the same bits as
    the two launchers); runs [1] int64 += the number of experts run."""
    tokens, h = x.shape
    experts = table.shape[0]
    if check:
        _check("x", x, torch.float32, (tokens, h))
        _check("router", router, torch.float32, (experts, h))
        _check("table", table, torch.int64, (experts, 4))
        _check("runs", runs, torch.int64, (1,))
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    out = torch.empty(tokens, h, dtype=torch.float32)
    if tokens:
        scratch, int_scratch = moe_scratch(tokens, h, (experts, top_k, inter))
        library().hr_moe(
            router.data_ptr(), experts, top_k, int(normalize), table.data_ptr(), int(int8),
            x.data_ptr(), tokens, h, inter, out.data_ptr(), scratch.data_ptr(),
            int_scratch.data_ptr(), runs.data_ptr(),
        )  # fmt: skip
    return out


def moe_experts(
    table: Tensor, int8: bool, x: Tensor, ids: Tensor, weights: Tensor, inter: int,
    check: bool = True, runs: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x [T, H] -> [T, H]: each token's experts ``ids`` [T, k] (int64) run on it, their
    outputs times ``weights`` [T, k] summed in ascending expert order
    (kernels/csrc/cpu/moe.cpp); each expert some token chose is read once. ``runs`` [1]
    int64, if given, += the number of experts run."""
    tokens, h = x.shape
    top_k = ids.shape[1]
    if check:
        _check("x", x, torch.float32, (tokens, h))
        _check("ids", ids, torch.int64, (tokens, top_k))
        _check("weights", weights, torch.float32, (tokens, top_k))
        _check("table", table, torch.int64, (None, 4))
        if runs is not None:
            _check("runs", runs, torch.int64, (1,))
        if tokens and not 0 <= int(ids.min()) <= int(ids.max()) < table.shape[0]:
            raise ValueError(f"ids must be in [0, {table.shape[0]})")
    out = torch.zeros(tokens, h, dtype=torch.float32)
    if tokens:
        scratch, int_scratch = moe_scratch(tokens, h, (table.shape[0], top_k, inter))
        library().hr_moe_experts(
            table.data_ptr(), table.shape[0], int(int8), x.data_ptr(), tokens, h, inter, top_k,
            ids.data_ptr(), weights.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            int_scratch.data_ptr(), None if runs is None else runs.data_ptr(),
        )  # fmt: skip
    return out

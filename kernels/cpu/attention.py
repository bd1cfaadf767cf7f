"""Launchers of the attention kernels (kernels/csrc/cpu/attention.cpp): RoPE with the
K/V cache write, and attention over the paged caches (kernels/metadata.py's layout)."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import reference
from kernels.cpu.library import check_tensor, library
from kernels.metadata import AttentionMetadata

# The KV cache dtypes the kernels read and write (kernels/csrc/cpu/common.h KvDtype): K and
# V are rounded to the cache dtype once, when written, and widened to fp32 when read. An
# int8 cache row is head_dim codes carrying their own bf16 scale (kernels/reference.py
# quantize_kv_rows).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def check_caches(key_cache: Tensor, value_cache: Tensor, shape: tuple[int | None, ...]) -> int:
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
    check_tensor("key_cache", key_cache, key_cache.dtype, shape)
    check_tensor("value_cache", value_cache, key_cache.dtype, key_cache.shape)
    return code


def check_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, meta: AttentionMetadata
) -> None:
    """What paged_attention needs of its arguments (ValueError naming the first that fails)."""
    tokens, num_heads, head_dim = query.shape
    num_blocks, _, num_kv_heads, _ = key_cache.shape
    check_tensor("query", query, torch.float32, (tokens, num_heads, head_dim))
    check_caches(key_cache, value_cache, (None, None, num_kv_heads, head_dim))
    check_tensor("block_tables", meta.block_tables, torch.int32, (meta.num_seqs, None))
    check_tensor("context_lens", meta.context_lens, torch.int32, (meta.num_seqs,))
    check_tensor("query_start_loc", meta.query_start_loc, torch.int32, (meta.num_seqs + 1,))
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


def check_rope(
    tokens: int, positions: Tensor, slot_mapping: Tensor, cos: Tensor, sin: Tensor, dim: int
) -> None:
    """What rope_and_cache needs of its positions, slots and tables: one position and one
    slot per token, tables of head dim ``dim``, each position < the tables' length."""
    check_tensor("positions", positions, torch.int64, (tokens,))
    check_tensor("slot_mapping", slot_mapping, torch.int64, (tokens,))
    check_tensor("cos", cos, torch.float32, (None, dim))
    check_tensor("sin", sin, torch.float32, cos.shape)
    if tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
        raise ValueError(f"positions must be in [0, {cos.shape[0]})")


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
        width = (num_heads + 2 * num_kv_heads) * head_dim
        check_tensor("qkv", qkv, torch.float32, (tokens, width))
        check_rope(tokens, positions, slot_mapping, cos, sin, head_dim)
        check_caches(key_cache, value_cache, (None, None, num_kv_heads, head_dim))
    q = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    library().hr_rope_and_cache(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), tokens, num_heads, num_kv_heads, head_dim, q.data_ptr(),
        key_cache.data_ptr(), value_cache.data_ptr(), KV_DTYPE_CODES[key_cache.dtype],
    )  # fmt: skip
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

"""Argument checks of the CUDA launchers in kernels/cuda/launch.py.

What the kernels accept (dtypes, head dims, block sizes), the checks that give a
ValueError naming the offending argument before anything is launched, and the choice
of copy word for the cache write. Everything here reads only host-side facts
(dtype, shape, contiguity, device, pointer alignment, AttentionMetadata's host
lists): device memory is never read back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels.metadata import AttentionMetadata

# These mirror the instantiations in the .cu files.
ATTENTION_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
_MAX_GRID_YZ = 65535
COPY_WORDS = ((16, "w16"), (4, "w4"), (2, "w2"))  # bytes per copy word, kernel suffix


def check_tensor(
    name: str,
    t: Any,
    dtype: torch.dtype,
    shape: tuple[int | None, ...],
    device: torch.device,
) -> None:
    """ValueError naming `name` unless t is a contiguous `dtype` tensor of `shape` on `device`.

    A None in `shape` accepts any size in that dimension.
    """
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(
        w is not None and g != w for g, w in zip(t.shape, shape, strict=True)
    ):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_aligned(name: str, t: Tensor, nbytes: int) -> None:
    if t.data_ptr() % nbytes != 0:
        raise ValueError(f"{name} must start on a {nbytes}-byte boundary (the kernels load 16 B)")


def copy_word(row_bytes: int, tensors: tuple[Tensor, ...]) -> tuple[int, str]:
    """The widest copy word dividing a token row and every pointer's alignment."""
    for width, suffix in COPY_WORDS:
        if row_bytes % width == 0 and all(t.data_ptr() % width == 0 for t in tensors):
            return width, suffix
    raise ValueError(f"token rows of {row_bytes} bytes cannot be copied in 2-byte words")


def check_query_and_cache(query: Tensor, key_cache: Tensor, value_cache: Tensor) -> None:
    if query.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"query must be one of {tuple(ATTENTION_DTYPES)}, got {query.dtype}")
    device = query.device
    check_tensor("query", query, query.dtype, (None, None, None), device)
    head_dim = query.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"query head dim must be one of {HEAD_DIMS}, got {head_dim}")
    check_tensor("key_cache", key_cache, query.dtype, (None, None, None, head_dim), device)
    check_tensor("value_cache", value_cache, query.dtype, tuple(key_cache.shape), device)
    if key_cache.shape[1] not in BLOCK_SIZES:
        raise ValueError(
            f"key_cache block size must be one of {BLOCK_SIZES}, got {key_cache.shape[1]}"
        )
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    _check_aligned("key_cache", key_cache, 16)
    _check_aligned("value_cache", value_cache, 16)


def check_metadata(meta: AttentionMetadata, num_rows: int, block_size: int, device) -> None:
    num_seqs = meta.num_seqs
    if num_seqs > _MAX_GRID_YZ:
        raise ValueError(f"meta: {num_seqs} sequences exceed the grid limit {_MAX_GRID_YZ}")
    check_tensor("meta.block_tables", meta.block_tables, torch.int32, (num_seqs, None), device)
    check_tensor("meta.context_lens", meta.context_lens, torch.int32, (num_seqs,), device)
    check_tensor("meta.query_start_loc", meta.query_start_loc, torch.int32, (num_seqs + 1,), device)
    if len(meta.context_lens_host) != num_seqs:
        raise ValueError("meta.context_lens_host must have one entry per sequence")
    if sum(meta.query_lens) > num_rows:
        raise ValueError(f"meta.query_lens sum to {sum(meta.query_lens)} > {num_rows} query rows")
    if any(0 < c < q for q, c in zip(meta.query_lens, meta.context_lens_host, strict=True)):
        # 0 is allowed: padding rows (their output is zeros).
        raise ValueError("meta: a context_len is shorter than its query_len")
    if max(meta.context_lens_host, default=0) > meta.block_tables.shape[1] * block_size:
        raise ValueError("meta.block_tables is too narrow for the longest context")

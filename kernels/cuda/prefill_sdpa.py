"""Prefill attention on tensor cores, a first step: torch SDPA over gathered pages.

The CuPy prefill kernel (csrc/paged_attention_prefill.cu) computes in fp32 on CUDA cores.
This path gathers each prefill sequence's K/V blocks out of the paged cache and calls
``F.scaled_dot_product_attention`` in the cache's dtype (fp16/bf16), which runs torch's
flash or memory-efficient kernels on tensor cores. It serves the sequences of a step with
query_len >= 2 (launch.paged_attention sends the decode rows to the CuPy decode kernel),
one SDPA call per sequence, in the model dtype: not bit-equal to the CuPy kernel (P is
rounded to the dtype before P @ V), within the tests' tolerances of the fp32 reference.

- A whole prompt without a window (query_len == context_len) takes SDPA's plain causal
  mask (``is_causal``, grouped-query heads through ``enable_gqa``): the flash kernel.
- A chunk over a cached prefix, or a sliding window, needs a bottom-right aligned mask,
  which flash does not take: each KV head's G query heads become G x Q rows of one head
  (row = position x G + member), so K/V are neither repeated nor asked of a GQA-capable
  kernel, and the boolean mask goes to the memory-efficient kernel.
- With a window only the keys from the first one any query of the chunk sees are
  gathered: the slots before it are never read (they may hold anything, even NaN).
- No soft-cap: SDPA has no score modifier, so soft-capped models (Gemma 2) keep the CuPy
  prefill kernel (launch.paged_attention decides).

Which prefill runs on CUDA is ``kernels.cuda.launch.prefill_variant`` ("cupy", the
default, or "sdpa"), a process-wide setting as ``decode_variant`` is, until a GPU run
(bench/gpu/cuda_kernels.py --prefill) has measured the two. Plain torch, so it runs on CPU
tensors too: tests/kernels/test_prefill_sdpa.py checks it against kernels/reference.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.metadata import AttentionMetadata


def prefill_attention(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> None:
    """Writes into ``out`` [T, H, D] the rows of every sequence with query_len >= 2; the
    other rows are left as they are. Loop control reads the metadata's host lists only."""
    start = 0
    for seq, qlen in enumerate(meta.query_lens):
        if qlen >= 2:
            rows = slice(start, start + qlen)
            table = meta.block_tables[seq]
            ctx = meta.context_lens_host[seq]
            out[rows] = attend_sequence(
                query[rows], key_cache, value_cache, table, ctx, scale, window
            )
        start += qlen


def attend_sequence(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    table: Tensor,
    ctx: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Queries [Q, H, D] at positions ctx - Q .. ctx - 1 over the sequence's cached keys
    (block table ``table``) -> [Q, H, D] in the query dtype."""
    qlen, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    first = 0 if window is None else max(0, ctx - qlen - window + 1)  # first key seen
    keys, values = (_gather(cache, table, first, ctx) for cache in (key_cache, value_cache))
    if qlen == ctx and (window is None or window >= ctx):  # a whole prompt: plain causal
        q = query.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            q, keys[None], values[None], is_causal=True, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    group = num_heads // num_kv_heads
    q = query.view(qlen, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    q = q.reshape(num_kv_heads, qlen * group, head_dim)
    mask = visible_keys(qlen, ctx, first, window, query.device).repeat_interleave(group, 0)
    out = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, scale=scale
    )
    out = out[0].view(num_kv_heads, qlen, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(qlen, num_heads, head_dim)


def _gather(cache: Tensor, table: Tensor, first: int, ctx: int) -> Tensor:
    """Positions first .. ctx - 1 of a sequence's cache rows -> [Hkv, ctx - first, D]."""
    block_size = cache.shape[1]
    low, high = first // block_size, -(-ctx // block_size)
    rows = cache.index_select(0, table[low:high]).flatten(0, 1)
    skip = first - low * block_size
    return rows[skip : skip + ctx - first].transpose(0, 1)


def visible_keys(
    qlen: int, ctx: int, first: int, window: int | None, device: torch.device
) -> Tensor:
    """[Q, ctx - first]: True where query ctx - Q + i sees key first + j (at or before it,
    and with a window within its last ``window`` keys); bottom-right aligned."""
    q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]
    k_pos = torch.arange(first, ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask

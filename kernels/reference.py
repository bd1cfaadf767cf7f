"""Torch reference kernels: the test oracle of the CPU and CUDA kernels, and the CPU fallback.

The CPU path is the C++ kernels (kernels/cpu/, kernels/csrc/cpu/); these run steps only
with ``--cpu-kernels torch`` or where those kernels cannot be built.

``reshape_and_cache`` writes a step's new K/V into the paged cache;
``paged_attention`` attends a flat, mixed batch (decodes and prefill chunks)
over that cache. Layout and mask semantics are defined in ``kernels.metadata``.

Decode tokens are computed together in a few buckets of similar context length:
one gather of their blocks and one ``scaled_dot_product_attention`` call per
bucket, so short contexts do not pay for the longest one's padding. Prefill chunks loop per
sequence, where the attention itself is large enough to amortise the loop.
K/V are gathered with ``index_select`` (several times faster on CPU than
advanced indexing) and everything is computed in fp32 whatever the cache dtype.

Cache dtypes: any float dtype holds K/V rounded to it (``.to``); an int8 cache holds
``head_dim`` codes per token and head and nothing else: the row's bf16 scale rides in the
parities of 16 groups of its codes (``quantize_kv_rows``, the layout kernels/csrc/cpu/common.h
kv_narrow writes).
Loop control reads only the metadata's host lists, so nothing syncs on a device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.metadata import AttentionMetadata


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dim for rows of ``head_dim`` values of ``dtype`` (every dtype: the
    head dim; an int8 row carries its scale inside its codes)."""
    del dtype
    return head_dim


def kv_head_dim(cache: Tensor) -> int:
    """The head dim of the rows a cache [N, B, Hkv, width] holds."""
    return cache.shape[-1]


def _groups(dim: int) -> int:
    """Codes per group of an int8 row of ``dim`` values (16 groups, one scale bit each)."""
    if dim % 16:
        raise ValueError(f"kv_cache_dtype int8: head_dim must be a multiple of 16, got {dim}")
    return dim // 16


def quantize_kv_rows(x: Tensor) -> Tensor:
    """fp32 rows [..., D] -> int8 rows [..., D] (D a multiple of 16), the scale inside.

    Per row: d = max|x| / 127 rounded up to a bf16, y = x * (1 / d), codes round(y) (ties to
    even) within +-127. Bit j of d's bf16 is the parity of group j's sum (codes j g .. j g +
    g - 1, g = D / 16): where it is wrong, the group's cheapest code moves one step, toward
    y (cost 1 - |y - code|) unless that leaves +-127 (then away, cost 1 + |y - code|), the
    first of equal costs.
    """
    x = x.to(torch.float32)
    g = _groups(x.shape[-1])
    amax = x.abs().amax(dim=-1, keepdim=True)
    # True divisions (a scalar over a tensor becomes a reciprocal times it in torch).
    d32 = amax / torch.full_like(amax, 127.0)
    bits = d32.contiguous().view(torch.int32)
    bits = torch.where(bits & 0xFFFF != 0, bits + 0x10000, bits) & -0x10000  # round up
    d = bits.view(torch.float32)
    inv = torch.where(d > 0, torch.full_like(d, 1.0) / d, torch.zeros_like(d))
    y = x * inv
    r = torch.round(y).clamp(-127, 127)
    codes = r.to(torch.int32).clamp(-127, 127)
    a = (y - r).abs()
    step = torch.where(y >= r, 1, -1).to(torch.int32)
    out = (codes + step).abs() > 127
    step = torch.where(out, -step, step)
    cost = torch.where(out, 1 + a, 1 - a)
    grouped = (*x.shape[:-1], 16, g)
    codes, step, cost = codes.view(grouped), step.view(grouped), cost.view(grouped)
    want = (bits >> torch.arange(16, 32, dtype=torch.int32, device=x.device)) & 1  # [..., 16]
    wrong = (codes & 1).sum(dim=-1) & 1 != want
    pick = cost.argmin(dim=-1, keepdim=True)  # the first of the cheapest
    move = torch.where(wrong.unsqueeze(-1), step.gather(-1, pick), 0)
    codes = codes.scatter_add(-1, pick, move)
    return codes.view(x.shape).to(torch.int8)


def kv_row_scales(rows: Tensor) -> Tensor:
    """int8 rows [..., D] -> their scales d [..., 1] (fp32)."""
    g = _groups(rows.shape[-1])
    parity = (rows.view(*rows.shape[:-1], 16, g).to(torch.int32) & 1).sum(dim=-1) & 1
    shifts = torch.arange(16, 32, dtype=torch.int32, device=rows.device)
    return (parity << shifts).sum(dim=-1, keepdim=True, dtype=torch.int32).view(torch.float32)


def dequantize_kv_rows(rows: Tensor) -> Tensor:
    """int8 rows [..., D] -> fp32 [..., D]: codes * d (exact in fp32)."""
    return rows.to(torch.float32) * kv_row_scales(rows)


def to_cache(x: Tensor, dtype: torch.dtype) -> Tensor:
    """K or V rows [..., D] as a cache of ``dtype`` holds them."""
    return quantize_kv_rows(x) if dtype == torch.int8 else x.to(dtype)


def from_cache(rows: Tensor) -> Tensor:
    """Cache rows back to fp32 [..., D]."""
    return dequantize_kv_rows(rows) if rows.dtype == torch.int8 else rows.to(torch.float32)


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into caches [N, B, Hkv, D] at ``slot_mapping`` (-1 skipped)."""
    num_blocks, block_size, num_kv_heads, width = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, width)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, width)
    slots = slot_mapping.to(torch.int64)
    # A boolean select needs no host-side "any padding?" check, so it never syncs.
    keep = slots >= 0
    flat_k.index_copy_(0, slots[keep], to_cache(key[keep], key_cache.dtype))
    flat_v.index_copy_(0, slots[keep], to_cache(value[keep], value_cache.dtype))


def _check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attend query [T, H, D] over the paged cache; returns [T, H, D] in the query dtype.

    Query head h reads KV head ``h // (H // Hkv)``. Sequence i's j-th query sits at
    position ``context_lens[i] - query_len + j`` and sees keys at positions <= it, and with
    a ``window`` only the last ``window`` of them (itself included: p - window < key <= p).
    ``softcap``: scores become tanh(s / softcap) * softcap before the mask (Gemma 2), as
    transformers' eager attention computes them.
    """
    _check_gqa(query.shape[1], key_cache.shape[2])
    starts = _host_starts(meta.query_lens)
    decode = [i for i, qlen in enumerate(meta.query_lens) if qlen == 1]
    groups = _decode_groups(decode, meta.context_lens_host)
    extra = (window, softcap)
    if len(groups) == 1 and len(decode) == meta.num_seqs == query.shape[0]:
        return _decode_attention(query, key_cache, value_cache, meta, None, scale, *extra)
    # Rows no sequence owns (batch padding) must come back finite, so zero them.
    covered = starts[-1] == query.shape[0]
    out = torch.empty_like(query) if covered else torch.zeros_like(query)
    for group in groups:
        rows = torch.tensor([starts[i] for i in group], dtype=torch.int64, device=query.device)
        attended = _decode_attention(
            query.index_select(0, rows), key_cache, value_cache, meta, group, scale, *extra
        )
        out.index_copy_(0, rows, attended)
    for i, qlen in enumerate(meta.query_lens):
        if qlen > 1:
            s, e = starts[i], starts[i] + qlen
            out[s:e] = _prefill_attention(
                query[s:e], key_cache, value_cache, meta, i, scale, *extra
            )
    return out


# A decode group pads every member to its longest context. Splitting where a context
# drops below this fraction of the group's longest bounds the padding per group, and
# the cap bounds the per-group launch overhead (a few small ops per layer).
_GROUP_SPLIT_RATIO = 0.6
_MAX_DECODE_GROUPS = 4
_MIN_GROUP_SIZE = 4


def _decode_groups(decode: list[int], context_lens: list[int]) -> list[list[int]]:
    """Decode sequences bucketed by context length, longest first (empty: no decodes)."""
    if not decode:
        return []
    order = sorted(decode, key=lambda i: context_lens[i], reverse=True)
    groups = [[order[0]]]
    for i in order[1:]:
        head = context_lens[groups[-1][0]]
        split = context_lens[i] < _GROUP_SPLIT_RATIO * head
        if split and len(groups[-1]) >= _MIN_GROUP_SIZE and len(groups) < _MAX_DECODE_GROUPS:
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


def _host_starts(query_lens: list[int]) -> list[int]:
    """Cumulative query offsets from the host list, so no device tensor is read back."""
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    return starts


def _decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    seqs: list[int] | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """One query per sequence ``seqs`` (None = all): query [S, H, D] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if seqs is None:
        tables, lens = meta.block_tables, meta.context_lens
        max_len = meta.max_context_len
    else:
        index = torch.tensor(seqs, dtype=torch.int64, device=query.device)
        tables, lens = meta.block_tables[index], meta.context_lens[index]
        max_len = max(meta.context_lens_host[i] for i in seqs)
    keys, values = _gather_kv(key_cache, value_cache, tables, max_len)  # [S, L, Hkv, D]
    key_pos = torch.arange(keys.shape[1], device=query.device)[None, :]
    valid = key_pos < lens[:, None].long()
    # Slots past context_len may hold garbage (even NaN), and masking cannot remove it:
    # SDPA adds the mask as -inf (NaN + -inf = NaN) and 0 * NaN = NaN in P @ V. So zero
    # those K/V rows; the cost scales with the padded rows only.
    padded_rows = (~valid).view(-1).nonzero().view(-1)
    keys.view(-1, num_kv_heads * head_dim).index_fill_(0, padded_rows, 0.0)
    values.view(-1, num_kv_heads * head_dim).index_fill_(0, padded_rows, 0.0)
    # GQA without repeating K/V: each KV head's query group acts as G queries of one "sequence".
    q = query.to(torch.float32).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    visible = valid
    if window is not None:  # the query sits at lens - 1: keys past lens - 1 - window hidden
        visible = valid & (key_pos > lens[:, None].long() - 1 - window)
    out = _attend(
        q, keys.transpose(1, 2), values.transpose(1, 2), visible[:, None, None, :], scale, softcap
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _gather_kv(
    key_cache: Tensor, value_cache: Tensor, tables: Tensor, max_len: int
) -> tuple[Tensor, Tensor]:
    """K/V of sequences with block tables [S, W] -> fp32 [S, L, Hkv, D], L >= max_len.

    Only the table columns that ``max_len`` reaches are read, not the padded width.
    """
    block_size = key_cache.shape[1]
    num_cols = -(-max_len // block_size)
    flat = tables[:, :num_cols].reshape(-1)
    shape = (tables.shape[0], num_cols * block_size, *key_cache.shape[2:])
    keys = from_cache(key_cache.index_select(0, flat).view(shape))
    values = from_cache(value_cache.index_select(0, flat).view(shape))
    return keys, values


def _prefill_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    seq: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """A chunk of queries [Q, H, D] of sequence ``seq`` over its cached tokens -> [Q, H, D]."""
    qlen = query.shape[0]
    ctx = meta.context_lens_host[seq]
    keys, values = _gather_kv(key_cache, value_cache, meta.block_tables[seq : seq + 1], ctx)
    # Slicing to ctx drops the unwritten tail, so no garbage reaches the product.
    keys, values = keys[0, :ctx].transpose(0, 1), values[0, :ctx].transpose(0, 1)
    q = query.to(torch.float32).transpose(0, 1)  # [H, Q, D]
    # A square chunk's bottom-right mask is the ordinary causal one, and SDPA's is_causal
    # path skips the masked half (~1.5x faster than an explicit mask at 1024 tokens).
    square = qlen == ctx
    if window is not None or softcap is not None:
        mask = _visible_mask(qlen, ctx, query.device, window)
        group = q.shape[0] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        out = _attend(q[None], keys[None], values[None], mask, scale, softcap)
        return out[0].transpose(0, 1).to(query.dtype)
    mask = None if square else _visible_mask(qlen, ctx, query.device)
    out = F.scaled_dot_product_attention(
        q[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=square,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(query.dtype)


def _visible_mask(qlen: int, ctx: int, device: torch.device, window: int | None = None) -> Tensor:
    """[Q, ctx] True where the key is at or before the query (bottom-right aligned causal),
    and with a window, after the query's position minus the window."""
    q_pos = torch.arange(ctx - qlen, ctx, device=device)
    k_pos = torch.arange(ctx, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None
) -> Tensor:
    """softmax(q k^T * scale, soft-capped, masked) v over [..., L, D] (k, v broadcast over
    q's leading dims); SDPA when there is no soft-cap. Every query sees at least itself."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # transformers' eager attention: (q k^T) * scale, / cap, tanh, * cap, masked, softmax.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)

"""Torch reference kernels against a plain dense causal attention written independently here."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import paged_attention, reshape_and_cache

HEAD_DIM = 16


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [Q, H, D] at the last Q of the ctx positions of k, v [ctx, Hkv, D]; fp64, head by head."""
    qlen, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    q_pos = torch.arange(ctx - qlen, ctx)[:, None]
    future = torch.arange(ctx)[None, :] > q_pos
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (q[:, h].double() @ kh.T * scale).masked_fill(future, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


class PagedCache:
    """A NaN-filled paged cache plus each sequence's scattered block table and its dense K/V."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, dtype=torch.float32):
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.block_size = block_size
        self.key = torch.full(shape, float("nan"), dtype=dtype)
        self.value = torch.full(shape, float("nan"), dtype=dtype)
        # Hand blocks out in a random order so tables are non-contiguous and unsorted.
        self.free = torch.randperm(num_blocks).tolist()

    def new_table(self, num_tokens: int) -> list[int]:
        count = math.ceil(num_tokens / self.block_size)
        table, self.free = self.free[:count], self.free[count:]
        return table

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        reshape_and_cache(k, v, self.key, self.value, meta.slot_mapping)


def random_kv(ctx: int, num_kv_heads: int, dtype=torch.float32):
    return (
        torch.randn(ctx, num_kv_heads, HEAD_DIM, dtype=dtype),
        torch.randn(ctx, num_kv_heads, HEAD_DIM, dtype=dtype),
    )


def run_batch(seqs, block_size: int, num_heads: int, num_kv_heads: int, dtype=torch.float32):
    """seqs: list of (query_len, context_len). Prefills the cached prefix, runs the batch.

    Returns (paged output, list of per-sequence dense oracle outputs, query_start offsets).
    """
    total_blocks = sum(math.ceil(ctx / block_size) for _, ctx in seqs) + 5
    cache = PagedCache(total_blocks, block_size, num_kv_heads, dtype)
    tables, kvs, queries = [], [], []
    for qlen, ctx in seqs:
        table = cache.new_table(ctx)
        k, v = random_kv(ctx, num_kv_heads, dtype)
        # The cached prefix goes in through its own earlier "step".
        if ctx > qlen:
            prior = AttentionMetadata.build([ctx - qlen], [ctx - qlen], [table], block_size)
            cache.write(k[: ctx - qlen], v[: ctx - qlen], prior)
        tables.append(table)
        kvs.append((k, v))
        queries.append(torch.randn(qlen, num_heads, HEAD_DIM, dtype=dtype))
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, block_size)
    new_k = torch.cat([k[ctx - qlen :] for (k, _), (qlen, ctx) in zip(kvs, seqs, strict=True)])
    new_v = torch.cat([v[ctx - qlen :] for (_, v), (qlen, ctx) in zip(kvs, seqs, strict=True)])
    cache.write(new_k, new_v, meta)
    scale = HEAD_DIM**-0.5
    out = paged_attention(torch.cat(queries), cache.key, cache.value, meta, scale)
    expected = [
        dense_causal_attention(q, k, v, scale) for q, (k, v) in zip(queries, kvs, strict=True)
    ]
    return out, expected


def assert_matches(out: torch.Tensor, expected: list[torch.Tensor], atol: float) -> None:
    assert torch.isfinite(out).all()
    assert torch.cat(expected).shape == out.shape
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=atol, rtol=atol)


# ---- reshape_and_cache ----


def test_reshape_and_cache_writes_slots_and_skips_padding():
    key_cache = torch.full((4, 4, 2, HEAD_DIM), 7.0)
    value_cache = torch.full((4, 4, 2, HEAD_DIM), -7.0)
    key, value = torch.randn(5, 2, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    slots = torch.tensor([13, -1, 0, 6, -1], dtype=torch.int64)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(16, 2, HEAD_DIM), value_cache.view(16, 2, HEAD_DIM)
    for token, slot in [(0, 13), (2, 0), (3, 6)]:
        assert torch.equal(flat_k[slot], key[token])
        assert torch.equal(flat_v[slot], value[token])
    untouched = [s for s in range(16) if s not in (13, 0, 6)]
    assert (flat_k[untouched] == 7.0).all()
    assert (flat_v[untouched] == -7.0).all()


def test_reshape_and_cache_matches_metadata_slots():
    block_size, table = 4, [3, 0, 2]
    meta = AttentionMetadata.build([6], [10], [table], block_size)
    key_cache = torch.zeros(4, block_size, 1, HEAD_DIM)
    value_cache = torch.zeros(4, block_size, 1, HEAD_DIM)
    key = torch.arange(1, 7, dtype=torch.float32)[:, None, None].expand(6, 1, HEAD_DIM)
    reshape_and_cache(key, -key, key_cache, value_cache, meta.slot_mapping)
    # Positions 4..9 -> block 0 slots 0..3, then block 2 slots 0..1.
    assert key_cache[0, :, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert key_cache[2, :2, 0, 0].tolist() == [5.0, 6.0]
    assert value_cache[2, :2, 0, 0].tolist() == [-5.0, -6.0]
    assert key_cache[3].abs().sum() == 0 and key_cache[1].abs().sum() == 0


# ---- paged attention vs dense ----


def _context_lens(block_size: int) -> list[int]:
    return sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 513})


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 1)])
def test_decode_batch_matches_dense(block_size, num_heads, num_kv_heads):
    torch.manual_seed(block_size * 100 + num_heads)
    seqs = [(1, ctx) for ctx in _context_lens(block_size)]
    out, expected = run_batch(seqs, block_size, num_heads, num_kv_heads)
    assert_matches(out, expected, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 1)])
def test_full_prefill_matches_dense(block_size, num_heads, num_kv_heads):
    torch.manual_seed(block_size * 100 + num_heads + 1)
    seqs = [(ctx, ctx) for ctx in _context_lens(block_size)]
    out, expected = run_batch(seqs, block_size, num_heads, num_kv_heads)
    assert_matches(out, expected, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 1)])
def test_mixed_batch_matches_dense(block_size, num_heads, num_kv_heads):
    torch.manual_seed(block_size * 100 + num_heads + 2)
    seqs = [
        (1, 513),  # decode
        (7, 40),  # chunk over a cached prefix
        (1, 1),  # decode of a one-token sequence
        (block_size + 1, block_size + 1),  # full prefill
        (1, block_size),  # decode filling its last block exactly
        (3, 513),  # small chunk at a long context
        (2, 2),
        (1, block_size + 1),
    ]
    out, expected = run_batch(seqs, block_size, num_heads, num_kv_heads)
    assert_matches(out, expected, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_types_match_dense(dtype, atol):
    torch.manual_seed(3)
    seqs = [(1, 513), (1, 17), (20, 20), (5, 100)]
    out, expected = run_batch(seqs, 16, 9, 3, dtype)
    assert out.dtype == dtype
    assert_matches(out, expected, atol=atol)


def test_padding_rows_come_back_zero():
    block_size, table = 4, [1, 0]
    meta = AttentionMetadata.build([1], [5], [table], block_size)
    key_cache = torch.randn(2, block_size, 1, HEAD_DIM)
    value_cache = torch.randn(2, block_size, 1, HEAD_DIM)
    query = torch.randn(3, 2, HEAD_DIM)  # one real token, two batch-padding rows
    out = paged_attention(query, key_cache, value_cache, meta, 0.25)
    assert torch.isfinite(out[0]).all()
    assert (out[1:] == 0).all()


def test_rejects_head_counts_that_do_not_group():
    meta = AttentionMetadata.build([1], [1], [[0]], 4)
    cache = torch.zeros(1, 4, 2, HEAD_DIM)
    with pytest.raises(ValueError):
        paged_attention(torch.zeros(1, 3, HEAD_DIM), cache, cache, meta, 1.0)


# ---- chunked prefill consistency ----


@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_matches_full_prefill(block_size):
    torch.manual_seed(4)
    num_heads, num_kv_heads, prompt_len, chunk = 9, 3, 47, 7
    q = torch.randn(prompt_len, num_heads, HEAD_DIM)
    k, v = random_kv(prompt_len, num_kv_heads)
    scale = HEAD_DIM**-0.5

    full_cache = PagedCache(64, block_size, num_kv_heads)
    table = full_cache.new_table(prompt_len)
    meta = AttentionMetadata.build([prompt_len], [prompt_len], [table], block_size)
    full_cache.write(k, v, meta)
    full = paged_attention(q, full_cache.key, full_cache.value, meta, scale)

    chunk_cache = PagedCache(64, block_size, num_kv_heads)
    table = chunk_cache.new_table(prompt_len)
    pieces = []
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        meta = AttentionMetadata.build([end - start], [end], [table], block_size)
        chunk_cache.write(k[start:end], v[start:end], meta)
        pieces.append(
            paged_attention(q[start:end], chunk_cache.key, chunk_cache.value, meta, scale)
        )
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)


# ---- batch invariance ----


def test_decode_is_the_same_alone_or_batched():
    """Padding a short decode to a long neighbour's width changes only rounding.

    Not bitwise: the matmul's reduction order over keys depends on the padded length.
    """
    torch.manual_seed(5)
    block_size, num_heads, num_kv_heads = 16, 9, 3
    cache = PagedCache(64, block_size, num_kv_heads)
    short_table, long_table = cache.new_table(40), cache.new_table(700)
    for table, ctx in [(short_table, 40), (long_table, 700)]:
        k, v = random_kv(ctx, num_kv_heads)
        cache.write(k, v, AttentionMetadata.build([ctx], [ctx], [table], block_size))
    q = torch.randn(2, num_heads, HEAD_DIM)
    alone_meta = AttentionMetadata.build([1], [40], [short_table], block_size)
    alone = paged_attention(q[:1], cache.key, cache.value, alone_meta, 0.125)
    batch_meta = AttentionMetadata.build([1, 1], [40, 700], [short_table, long_table], block_size)
    batched = paged_attention(q, cache.key, cache.value, batch_meta, 0.125)
    torch.testing.assert_close(alone[0], batched[0], atol=1e-6, rtol=1e-6)


def test_sequences_with_no_tokens_this_step_are_skipped():
    torch.manual_seed(6)
    block_size, num_kv_heads = 16, 3
    cache = PagedCache(8, block_size, num_kv_heads)
    idle_table, live_table = cache.new_table(20), cache.new_table(30)
    k, v = random_kv(30, num_kv_heads)
    meta = AttentionMetadata.build([0, 1], [20, 30], [idle_table, live_table], block_size)
    cache.write(k[29:], v[29:], meta)
    cache.write(k[:29], v[:29], AttentionMetadata.build([29], [29], [live_table], block_size))
    q = torch.randn(1, 9, HEAD_DIM)
    out = paged_attention(q, cache.key, cache.value, meta, 0.125)
    assert_matches(out, [dense_causal_attention(q, k, v, 0.125)], atol=1e-5)


def test_empty_batch():
    meta = AttentionMetadata.build([], [], [], 16)
    cache = torch.zeros(1, 16, 1, HEAD_DIM)
    out = paged_attention(torch.zeros(0, 2, HEAD_DIM), cache, cache, meta, 1.0)
    assert out.shape == (0, 2, HEAD_DIM)

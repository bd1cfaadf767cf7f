"""The CUDA kernels' sliding window and soft-cap against the torch reference.

The same two backends as tests/kernels/test_kernels_gpu.py (whose batches, checks and
fixtures these reuse): the real kernels on a CUDA device (marked `gpu`, skipped without
one) and the kernels' source in the host emulation on the CPU (a smaller matrix).

The rule is kernels/reference.py's: the query at position p sees keys p - window < k <= p,
and scores become tanh(s / softcap) * softcap after the scale, before the mask. Before the
kernels run, run_and_check overwrites with NaN every cache slot that lies before all of a
sequence's queries' windows: a kernel that used those slots, even weighted by zero,
would return NaN. Each case also checks that the window or cap changes the
reference's answer, so that no comparison is vacuous.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from kernels.cuda import attention_plan
from kernels.cuda import launch as cuda
from tests.kernels.test_kernels_gpu import (
    CONFIG_IDS,
    CONFIGS,
    EMULATED,
    EMULATED_IDS,
    Batch,
    _concat,
    _poison_before_windows,
    _real_meta,
    make_batch,
    on_gpu,
    pin_partition_size,
    run_and_check,
)

# Sliding windows and soft-caps. The windows: shorter than a block, not a multiple of the
# block size (24 for 16, shorter than 32), several partitions of 64, longer than any context.
WINDOWS = [5, 24, 100, 300, 5000]
# Verification-like queries of a few tokens, chunks over a long prefix, whole prompts.
WINDOW_PREFILL_SEQS = [(2, 2), (37, 37), (16, 300), (64, 600), (3, 200), (5, 90), (2, 41)]
WINDOW_MIXED = [(1, 700), (7, 30), (1, 3), (20, 20), (1, 1), (2, 513), (4, 64), (1, 1030)]
SOFTCAP_SCALE = 0.5  # scores of a few units, so that a cap of 2 bends them hard


def window_decode_contexts(block_size: int, window: int, long_context: int) -> list[int]:
    """Contexts around the block size, the window and its multiples, and a long one."""
    around = [1, block_size - 1, block_size + 1, window - 1, window, window + 1]
    around += [window + block_size + 3, 2 * window + 5, 513, long_context]
    return sorted({c for c in around if 0 < c <= long_context})


def _assert_matters(batch: Batch, scale, window, softcap) -> None:
    """The window / cap changes the reference's answer: the comparison is not vacuous."""
    scale = scale if scale is not None else 1.0 / math.sqrt(batch.query.shape[-1])
    real = batch.query[: batch.real_rows].float()
    caches = (batch.key_cache.float(), batch.value_cache.float())
    meta = _real_meta(batch)
    plain = reference.paged_attention(real, *caches, meta, scale)
    bent = reference.paged_attention(real, *caches, meta, scale, window, softcap)
    assert (plain - bent).abs().max().item() > 0.1


def check_decode_window(
    device, dtype, head_dim, block_size, group, window, softcap=None, scale=None, long_context=1100
):
    contexts = window_decode_contexts(block_size, window or long_context, long_context)
    batch = make_batch(
        [(1, c) for c in contexts],
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        padding=2,
        extra_rows=1,
        seed=window or 1,
    )
    if softcap is not None or (window or long_context) < long_context:
        _assert_matters(batch, scale, window, softcap)
    run_and_check(batch, scale, window, softcap)


def check_prefill_window(
    device, dtype, head_dim, block_size, group, window, softcap=None, scale=None,
    seqs=WINDOW_PREFILL_SEQS,
):  # fmt: skip
    kwargs = dict(group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, device=device)
    batch = make_batch(seqs, **kwargs, extra_rows=3, seed=window or 1)
    if softcap is not None or (window or 10**9) < max(c for _, c in seqs):
        _assert_matters(batch, scale, window, softcap)
    run_and_check(batch, scale, window, softcap)


def check_mixed_window(device, dtype, head_dim, block_size, group, window, softcap):
    kwargs = dict(group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, device=device)
    batch = make_batch(WINDOW_MIXED, **kwargs, padding=3, extra_rows=2)
    _assert_matters(batch, SOFTCAP_SCALE, window, softcap)
    run_and_check(batch, SOFTCAP_SCALE, window, softcap)


def test_poisoning_covers_exactly_the_slots_before_each_window():
    """run_and_check's NaN fill (one index_fill per cache) against the slot-by-slot rule."""
    kwargs = dict(group=1, head_dim=64, block_size=16, dtype=torch.float32, device="cpu")
    batch = make_batch([(1, 40), (5, 90), (3, 3), (1, 17)], **kwargs, padding=1)
    window = 20
    expected = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    tables = batch.meta.block_tables.tolist()
    for i in range(batch.real_seqs):
        qlen, ctx = batch.meta.query_lens[i], batch.meta.context_lens_host[i]
        for pos in range(max(0, ctx - qlen - window + 1)):
            expected[tables[i][pos // 16], pos % 16] = True
    was_nan = batch.key_cache.isnan().all(-1).all(-1)  # unused blocks start as NaN
    _poison_before_windows(batch, window)
    for cache in (batch.key_cache, batch.value_cache):
        assert torch.equal(cache.isnan().all(-1).all(-1), was_nan | expected)
    assert expected.sum() == (40 - 20) + (90 - 5 - 20 + 1)  # seqs 0 and 1; 2 and 3 see all


# ----------------------------------------------------------------------------- gpu
# On a GPU the window and soft-cap grids run at one dtype and block size, the engine's
# defaults on CUDA (bf16, 16), with every head dim and group, and the engine's decode
# kernel (decode_variant unset): the one device call has a limited time for every kernel
# test (bench/gpu/gpu_check.sh). The partition-size and group-of-16 tests run both kernels
# and the other dtype or block size. The emulated tests run both kernels on all dtypes and
# block sizes.
WINDOW_CONFIGS = [c for c in CONFIGS if c[0] == torch.bfloat16 and c[2] == 16]
WINDOW_CONFIG_IDS = [i for c, i in zip(CONFIGS, CONFIG_IDS, strict=True) if c in WINDOW_CONFIGS]


@on_gpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype,head_dim,block_size,group", WINDOW_CONFIGS, ids=WINDOW_CONFIG_IDS)
def test_decode_window_gpu(dtype, head_dim, block_size, group, window):
    check_decode_window("cuda", dtype, head_dim, block_size, group, window, long_context=4096)


@on_gpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype,head_dim,block_size,group", WINDOW_CONFIGS, ids=WINDOW_CONFIG_IDS)
def test_prefill_window_gpu(dtype, head_dim, block_size, group, window):
    seqs = WINDOW_PREFILL_SEQS + [(200, 1000), (64, 4096)]
    check_prefill_window("cuda", dtype, head_dim, block_size, group, window, seqs=seqs)


@on_gpu
@pytest.mark.parametrize("window", [None, 24, 300], ids=["full", "w24", "w300"])
@pytest.mark.parametrize("dtype,head_dim,block_size,group", WINDOW_CONFIGS, ids=WINDOW_CONFIG_IDS)
def test_softcap_gpu(dtype, head_dim, block_size, group, window):
    args = ("cuda", dtype, head_dim, block_size, group, window, 2.0, SOFTCAP_SCALE)
    check_decode_window(*args, long_context=4096)
    check_prefill_window(*args)
    check_mixed_window("cuda", dtype, head_dim, block_size, group, window or 5000, 2.0)


@on_gpu
@pytest.mark.parametrize("size", attention_plan.PARTITION_SIZES)
@pytest.mark.parametrize("window", [5, 100, 600], ids=["w5", "w100", "w600"])
def test_decode_window_partition_sizes_gpu(monkeypatch, window, size, decode_variant):
    """Windows against every partition size: partitions before the window do not run."""
    pin_partition_size(monkeypatch, size)
    check_decode_window("cuda", torch.float16, 128, 16, 8, window, long_context=4096)
    check_decode_window("cuda", torch.bfloat16, 64, 32, 3, window, 2.0, SOFTCAP_SCALE, 2000)


@on_gpu
def test_window_group_of_sixteen_gpu(decode_variant):
    check_decode_window("cuda", torch.float16, 128, 16, 16, 100, 2.0, SOFTCAP_SCALE, 2000)
    check_prefill_window("cuda", torch.float16, 128, 16, 16, 100, 2.0, SOFTCAP_SCALE)


# ----------------------------------------------------------------------------- emulated (CPU)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype,head_dim,block_size,group", EMULATED, ids=EMULATED_IDS)
def test_decode_window_emulated(
    emulated, dtype, head_dim, block_size, group, window, decode_variant
):
    check_decode_window(emulated, dtype, head_dim, block_size, group, window)


@pytest.mark.parametrize("window", [5, 24, 100])
@pytest.mark.parametrize("size", [64, 512])
def test_decode_window_partitions_emulated(emulated, monkeypatch, size, window, decode_variant):
    """Several partitions of 64 inside the window, the window starting inside one of 512:
    partitions wholly before it do not run, the merge takes only those that did."""
    pin_partition_size(monkeypatch, size)
    check_decode_window(emulated, torch.float16, 64, 16, 3, window)
    check_decode_window(emulated, torch.bfloat16, 128, 32, 8, window + 200)


@pytest.mark.parametrize("window", [5, 24, 100, 5000])
@pytest.mark.parametrize("dtype,head_dim,block_size,group", EMULATED, ids=EMULATED_IDS)
def test_prefill_window_emulated(emulated, dtype, head_dim, block_size, group, window):
    check_prefill_window(emulated, dtype, head_dim, block_size, group, window)


@pytest.mark.parametrize("window", [None, 24, 100], ids=["full", "w24", "w100"])
@pytest.mark.parametrize("dtype,head_dim,block_size,group", EMULATED[:2], ids=EMULATED_IDS[:2])
def test_softcap_emulated(emulated, dtype, head_dim, block_size, group, window, decode_variant):
    args = (emulated, dtype, head_dim, block_size, group, window, 2.0, SOFTCAP_SCALE)
    check_decode_window(*args)
    check_prefill_window(*args)


@pytest.mark.parametrize("window,softcap", [(50, None), (50, 2.0), (5000, 2.0)])
def test_mixed_batch_window_emulated(emulated, window, softcap, decode_variant):
    check_mixed_window(emulated, torch.float16, 64, 32, 3, window, softcap)


def test_window_batch_invariance_emulated(emulated, monkeypatch, decode_variant):
    """A windowed, soft-capped sequence's output is the same bits alone and in a batch."""
    pin_partition_size(monkeypatch, 64)
    kwargs = dict(group=3, head_dim=64, block_size=16, dtype=torch.bfloat16, device=emulated)
    alone = make_batch([(1, 600), (9, 40)], **kwargs, seed=7)
    merged = _concat(alone, make_batch([(1, 50), (5, 900)], **kwargs, seed=8))
    args = (0.125, 100, 2.0)
    out_alone = cuda.paged_attention(
        alone.query, alone.key_cache, alone.value_cache, alone.meta, *args
    )
    out = cuda.paged_attention(
        merged.query, merged.key_cache, merged.value_cache, merged.meta, *args
    )
    assert torch.equal(out[: alone.real_rows], out_alone)

"""The SDPA prefill path (kernels/cuda/prefill_sdpa.py) against the torch reference, on the CPU.

The path is plain torch, so it runs here on CPU tensors: the same batches as the CUDA
kernels' tests (tests/kernels/test_kernels_gpu.py: caches filled with NaN before the used
slots are written, blocks in random order), chunks over cached prefixes and whole prompts,
grouped-query heads, sliding windows with the slots before every window overwritten with
NaN (reading one would show). fp32 inputs must match the fp32 reference to rounding; fp16
and bf16 inputs within the tolerances below (SDPA rounds P to the dtype before P @ V,
which the fp32 CuPy kernel does not). The dispatch inside kernels.cuda.paged_attention
(decode rows to the CuPy decode kernel, prefill rows to SDPA, soft-capped calls to the
CuPy prefill kernel) runs in the host emulation of the kernels. On a GPU:
test_kernels_gpu.py's test_prefill_sdpa_gpu.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from kernels.cuda import launch as cuda
from kernels.cuda import prefill_sdpa
from tests.kernels.test_kernels_gpu import (
    _poison_before_windows,
    _real_meta,
    make_batch,
    run_and_check,
)

SEQS = [(2, 2), (37, 37), (16, 300), (64, 600), (3, 200), (5, 90), (128, 128), (1, 50)]
# Relative error ||out - ref|| / ||ref|| and largest absolute error, per input dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1e-2, 4e-2),
}


def _check(dtype, head_dim, block_size, group, window, seqs=SEQS):
    batch = make_batch(
        seqs, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, device="cpu",
        extra_rows=2, seed=window or 3,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    real = batch.query[: batch.real_rows].float()
    caches = (batch.key_cache.float(), batch.value_cache.float())
    expected = reference.paged_attention(real, *caches, _real_meta(batch), scale, window)
    if window is not None:
        _poison_before_windows(batch, window)
    out = torch.full_like(batch.query, float("nan"))
    prefill_sdpa.prefill_attention(
        out, batch.query, batch.key_cache, batch.value_cache, batch.meta, scale, window
    )
    starts = batch.meta.query_start_loc.tolist()
    rel_tol, abs_tol = TOLERANCES[dtype]
    for i, qlen in enumerate(batch.meta.query_lens[: batch.real_seqs]):
        got, want = out[starts[i] : starts[i + 1]], expected[starts[i] : starts[i + 1]]
        if qlen == 1:  # decode rows are not the path's: left as they were
            assert got.isnan().all()
            continue
        assert not got.isnan().any(), f"seq {i}: NaN (read a slot before the window?)"
        got = got.float()
        rel = ((got - want).norm() / want.norm()).item()
        worst = (got - want).abs().max().item()
        assert rel < rel_tol and worst < abs_tol, f"seq {i} ({qlen}, {starts}): {rel=} {worst=}"
    assert out[batch.real_rows :].isnan().all()  # rows no sequence owns: untouched


@pytest.mark.parametrize("window", [None, 5, 24, 100, 300, 5000])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_matches_the_reference_fp32(group, window):
    _check(torch.float32, 64, 16, group, window)


@pytest.mark.parametrize("window", [None, 24, 300])
@pytest.mark.parametrize(
    "dtype,head_dim,block_size",
    [(torch.bfloat16, 64, 16), (torch.float16, 128, 32), (torch.bfloat16, 128, 16)],
    ids=["bf16-d64-b16", "f16-d128-b32", "bf16-d128-b16"],
)
def test_matches_the_reference_half(dtype, head_dim, block_size, window):
    _check(dtype, head_dim, block_size, 3, window)


def test_the_window_starts_inside_a_block():
    """Windows whose first key is mid-block, for chunks and whole prompts alike."""
    for window in (1, 2, 15, 17, 33):
        _check(torch.float32, 64, 16, 2, window, seqs=[(40, 40), (7, 100), (2, 33)])


def test_visible_keys_is_bottom_right_aligned():
    mask = prefill_sdpa.visible_keys(3, 6, 0, None, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    windowed = prefill_sdpa.visible_keys(3, 6, 2, 2, torch.device("cpu"))  # keys 2..5
    assert windowed.int().tolist() == [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


# ----------------------------------------------------------------------------- the dispatch


@pytest.fixture
def launched(emulated, monkeypatch) -> list[str]:
    """Names of the kernels launched (in the emulation)."""
    names: list[str] = []
    real = cuda._launch

    def record(device, file, name, *rest):
        names.append(name)
        return real(device, file, name, *rest)

    monkeypatch.setattr(cuda, "_launch", record)
    return names


MIXED = [(1, 700), (7, 30), (1, 3), (20, 20), (2, 513), (1, 1030)]


@pytest.mark.parametrize("window", [None, 50])
def test_paged_attention_sends_prefills_to_sdpa(launched, monkeypatch, window):
    """Decode rows through the (emulated) CuPy decode kernel, prefill rows through SDPA:
    no prefill kernel launched; the mixed batch within the kernels' tolerances."""
    monkeypatch.setattr(cuda, "prefill_variant", "sdpa")
    kwargs = dict(group=3, head_dim=64, block_size=16, dtype=torch.float16, device="cpu")
    run_and_check(make_batch(MIXED, **kwargs, padding=2, extra_rows=1), None, window)
    assert any(n.startswith("paged_attention_decode_") for n in launched)
    assert not any(n.startswith("paged_attention_prefill_") for n in launched)


def test_soft_capped_prefills_keep_the_cupy_kernel(launched, monkeypatch):
    monkeypatch.setattr(cuda, "prefill_variant", "sdpa")
    kwargs = dict(group=3, head_dim=64, block_size=16, dtype=torch.float16, device="cpu")
    run_and_check(make_batch(MIXED, **kwargs), 0.5, 50, 2.0)
    assert any(n.startswith("paged_attention_prefill_") for n in launched)


def test_an_unknown_prefill_variant_is_refused(monkeypatch):
    monkeypatch.setattr(cuda, "prefill_variant", "flash")
    with pytest.raises(ValueError, match="prefill variant must be one of"):
        cuda._prefill_by_sdpa(None)

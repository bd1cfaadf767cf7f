"""The CPU kernels (kernels/csrc/cpu/, launched by kernels/cpu/) against the reference.

Quantized linears against the dense fp32 product of the same weights (and those weights
bit-exact against gguf's own dequantizer), attention against kernels/reference.py over
NaN-filled scattered caches, and the fused elementwise steps against their torch forms.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import reference
from kernels.cpu import attention as cpu_attention
from kernels.cpu.attention import KV_DTYPE_CODES, paged_attention, rope_and_cache
from kernels.cpu.elementwise import (
    add_rms_norm,
    argmax_rows,
    gelu_tanh_mul,
    head_rms_norm,
    rms_norm,
    silu_mul,
)
from kernels.cpu.library import SIGNATURES, available, library, use_torch_threads
from kernels.cpu.quant import FORMATS, QuantizedWeight
from kernels.cpu.quant_linear import dequantize_rows, quant_linear, quantize_activations
from kernels.metadata import AttentionMetadata
from tests.kernels.test_paged_attention_ref import PagedCache

pytestmark = pytest.mark.skipif(not available(), reason="CPU kernels cannot be built here")

GGUF_TYPES = {
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
# The formats regrouped per row (and tiled for the int8 kernel); those kept in the file's
# order (K-quants, Q5_x) are tested in test_cpu_kquants.py.
REGROUPED = sorted(name for name, f in FORMATS.items() if not f.file_order)


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid GGUF blocks: finite fp16 scales (and mins), random codes."""
    g = torch.Generator().manual_seed(seed)
    f = FORMATS[fmt]
    nb = cols // 32
    raw = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, nb, f.scale_fields, generator=g) * 0.02 - 0.01).half()
    raw[:, :, : 2 * f.scale_fields] = scales.view(torch.uint8).reshape(rows, nb, -1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", REGROUPED)
def test_packed_weights_dequantize_bit_exact_to_gguf(fmt):
    blocks = random_blocks(fmt, 8, 96)
    expected = gguf.quants.dequantize(blocks.numpy(), GGUF_TYPES[fmt]).reshape(8, 96)
    weight = QuantizedWeight.from_gguf(fmt, blocks, 96)
    assert torch.equal(weight.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))
    assert torch.equal(dequantize_rows(weight), weight.dequantize())
    rows = torch.tensor([5, 0, 5], dtype=torch.int64)
    assert torch.equal(dequantize_rows(weight, rows), weight.dequantize()[rows])


@pytest.mark.parametrize("fmt", REGROUPED)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 13, 100, 200])
def test_quant_linear_matches_dense_product(fmt, n):
    rows, cols = 4 * 9 + 3, 160  # a tail of rows that is not a multiple of 4
    weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, cols, seed=n), cols)
    x = torch.randn(n, cols)
    bias = torch.randn(rows)
    expected = x.double() @ weight.dequantize().double().T + bias.double()
    got = quant_linear(x, weight, bias)
    assert got.shape == (n, rows)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_quant_linear_rows_do_not_depend_on_the_batch():
    """Every kernel sums a row's dot product in one order: batch invariance is bitwise."""
    weight = QuantizedWeight.from_gguf("q4_1", random_blocks("q4_1", 64, 576), 576)
    x = torch.randn(40, 576)
    whole = quant_linear(x, weight)
    for n in (1, 2, 5, 6, 11):
        assert torch.equal(quant_linear(x[:n].contiguous(), weight), whole[:n])


def test_quant_linear_checks_its_arguments():
    weight = QuantizedWeight.from_gguf("q8_0", random_blocks("q8_0", 4, 64), 64)
    with pytest.raises(ValueError, match="x must have shape"):
        quant_linear(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="the int8 kernel reads the tiled"):
        quant_linear(torch.randn(2, 64), weight, int8=True)
    with pytest.raises(ValueError, match="the fp32 kernel reads the per-row"):
        quant_linear(torch.randn(2, 64), weight.tiled())
    with pytest.raises(ValueError, match="x must be a contiguous CPU torch.float32"):
        quant_linear(torch.randn(2, 64, dtype=torch.float64), weight)


def test_rms_norm_and_residual_add():
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)

    def norm(v):
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(rms_norm(x, weight, 1e-5), norm(x))
    expected_residual = residual + x
    out = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, norm(expected_residual))


def test_silu_mul_including_extreme_values():
    gate_up = torch.randn(3, 64) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def nan_cache(blocks: int, block_size: int, kv_heads: int, dim: int, dtype) -> torch.Tensor:
    """A cache whose every row reads as NaN: NaN floats, or int8 codes whose carried scale
    is NaN."""
    shape = (blocks, block_size, kv_heads, reference.kv_row_width(dim, dtype))
    rows = reference.to_cache(torch.full(shape, float("nan")), dtype)
    assert reference.from_cache(rows).isnan().all()
    return rows


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rope_and_cache_matches_the_model_rotary_and_cache_write(kv_dtype):
    """A 16-bit cache holds K and V rounded once, to nearest as torch's .to() rounds: the
    kernel's write and the reference's give the same bits."""
    from compute.models.decoder import RotaryEmbedding
    from compute.models.rope import default_inv_freq

    heads, kv_heads, dim, tokens = 6, 2, 32, 5
    rope = RotaryEmbedding(default_inv_freq(dim, 10000.0), 64, "cpu", torch.float32)
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(1)
    )
    positions = torch.tensor([0, 7, 8, 33, 63])
    slots = torch.tensor([3, -1, 0, 17, 9])
    kc = nan_cache(5, 4, kv_heads, dim, kv_dtype)
    vc = torch.zeros_like(kc)
    ref_k, ref_v = kc.clone(), vc.clone()
    q = rope_and_cache(qkv, positions, rope.cos, rope.sin, kc, vc, slots, heads)
    q_ref, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q_ref = rope(q_ref.reshape(tokens, heads, dim), positions)
    k = rope(k.reshape(tokens, kv_heads, dim), positions)
    reference.reshape_and_cache(k, v.reshape(tokens, kv_heads, dim), ref_k, ref_v, slots)
    torch.testing.assert_close(q, q_ref)
    if kv_dtype == torch.float32:
        torch.testing.assert_close(kc, ref_k, equal_nan=True)
        torch.testing.assert_close(vc, ref_v)
    else:  # the rotation is fp32 on both sides (an ulp apart at most), then one rounding
        assert torch.equal(vc, ref_v)
        written = slots[slots >= 0]
        width = kc.shape[-1]
        flat = reference.from_cache(kc.view(-1, kv_heads, width)[written])
        ref_flat = reference.from_cache(ref_k.view(-1, kv_heads, width)[written])
        if kv_dtype == torch.int8:
            # The scale comes from the row's largest rotated value, which the two rotations
            # may give an ulp apart: the bf16 scales equal (or a bf16 ulp apart when the
            # ulp crosses one), codes the same but at rounding ties (and then the code a
            # group moves to set its parity may differ too).
            rows, ref_rows = (c.view(-1, kv_heads, width)[written] for c in (kc, ref_k))
            scales, ref_scales = reference.kv_row_scales(rows), reference.kv_row_scales(ref_rows)
            torch.testing.assert_close(scales, ref_scales, rtol=2**-7, atol=0)
            assert (scales == ref_scales).float().mean() > 0.9
            assert ((flat - ref_flat).abs() <= 2 * scales * 1.01).all()
            assert (rows == ref_rows).float().mean() > 0.99
        else:
            ulp = torch.finfo(kv_dtype).eps  # a half-ulp of rounding at most, either side
            torch.testing.assert_close(flat, ref_flat, rtol=ulp, atol=1e-6)
            assert (flat == ref_flat).float().mean() > 0.99  # ties of fp32 rotation apart


def int8_rows_hard_to_round(rows: int, dim: int) -> torch.Tensor:
    """fp32 rows [rows, dim] where the int8 cache's rounding is delicate: random scales
    over 60 decades, zero rows, one nonzero value, values exactly halfway between codes and
    exactly on codes (of the row's own bf16 scale), negative-only rows."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-30, 30, rows).unsqueeze(1)
    x[0] = 0.0
    x[1] = 0.0
    x[1, 3] = -2.5
    x[2] = -x[2].abs()
    for r in range(3, rows, 3):  # codes and half-codes of the scale the row will get
        d = reference.kv_row_scales(reference.quantize_kv_rows(x[r : r + 1]))[0, 0]
        k = torch.randint(-127, 128, (dim,), generator=g).float()
        half = torch.rand(dim, generator=g) < 0.5
        x[r] = (k + torch.where(half, 0.5, 0.0)).clamp(-127, 127) * d
        x[r, 0] = 127 * d
    return x


@pytest.mark.parametrize("dim", [16, 32, 64, 80, 128, 256])
def test_int8_cache_rows_carry_their_scale_in_dim_bytes(dim):
    """An int8 cache row is its D codes and nothing else: the C++ write gives the
    reference's bytes on rows that are hard to round, the bf16 scale d the codes' group
    parities carry covers the row (max|x| / 127 <= d within a bf16 rounding up), and every
    value decodes within d / 2 but at most one per group of D / 16 (the code that moved a
    step to set the group's parity), which stays within d."""
    rows = 600
    x = int8_rows_hard_to_round(rows, dim)
    qkv = torch.cat([torch.zeros(rows, 2 * dim), x], dim=1)  # one head, one KV head: v = x
    one = torch.ones(1, dim)
    kc = torch.zeros(rows, 1, 1, dim, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    rope_and_cache(
        qkv, torch.zeros(rows, dtype=torch.int64), one, one * 0, kc, vc,
        torch.arange(rows, dtype=torch.int64), 1,
    )  # fmt: skip
    want = reference.quantize_kv_rows(x)
    assert want.shape == (rows, dim)
    assert torch.equal(vc.view(rows, dim), want)
    d = reference.kv_row_scales(want)
    amax = x.abs().amax(-1, keepdim=True)
    assert (d >= amax / 127).all() and (d <= amax / 127 * (1 + 2**-7)).all()
    err = (reference.dequantize_kv_rows(want) - x).abs() / torch.where(d > 0, d, 1.0)
    assert (err <= 1 + 1e-6).all()
    assert ((err > 0.5 + 1e-6).view(rows, 16, dim // 16).sum(-1) <= 1).all()
    assert not want[0].any()  # a zero row: zero codes, zero scale


def test_int8_cache_needs_a_head_dim_of_sixteens():
    with pytest.raises(ValueError, match="kv_cache_dtype int8: head_dim must be a multiple of 16"):
        reference.quantize_kv_rows(torch.ones(2, 40))


def build_case(seqs, block_size, heads, kv_heads, dim=64, seed=0, kv_dtype=torch.float32):
    """A NaN-filled cache of kv_dtype with scattered tables; every sequence's context
    written (the same K/V values whatever the dtype, rounded to it)."""
    torch.manual_seed(seed)
    total = sum(-(-ctx // block_size) for _, ctx in seqs) + 3
    cache = PagedCache(total, block_size, kv_heads)
    cache.key = nan_cache(total, block_size, kv_heads, dim, kv_dtype)
    cache.value = nan_cache(total, block_size, kv_heads, dim, kv_dtype)
    tables = [cache.new_table(ctx) for _, ctx in seqs]
    full = AttentionMetadata.build([c for _, c in seqs], [c for _, c in seqs], tables, block_size)
    tokens = sum(c for _, c in seqs)
    reference.reshape_and_cache(
        torch.randn(tokens, kv_heads, dim),
        torch.randn(tokens, kv_heads, dim),
        cache.key,
        cache.value,
        full.slot_mapping,
    )
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, block_size)
    query = torch.randn(sum(q for q, _ in seqs), heads, dim)
    return query, cache, meta


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 1)],
        [(1, 15), (1, 16), (1, 17), (1, 600)],
        [(7, 7), (1, 40), (5, 37), (20, 100)],
        [(33, 33)],
    ],
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention_matches_reference(seqs, block_size, kv_dtype):
    """On the same cache (of any dtype: both widen its values exactly), the fp32 bound."""
    query, cache, meta = build_case(seqs, block_size, heads=9, kv_heads=3, kv_dtype=kv_dtype)
    scale = 64**-0.5
    expected = reference.paged_attention(query, cache.key, cache.value, meta, scale)
    got = paged_attention(query, cache.key, cache.value, meta, scale)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [16, 80, 128, 256])
def test_an_int8_cache_of_any_head_dim_matches_reference(dim):
    """The kernels read an int8 row's carried scale with one mask per 64 codes (D = 64, 128,
    256) or code by code (16, 80): both give the reference's values."""
    seqs = [(1, 40), (5, 37), (20, 100)]
    query, cache, meta = build_case(seqs, 16, heads=4, kv_heads=2, dim=dim, kv_dtype=torch.int8)
    expected = reference.paged_attention(query, cache.key, cache.value, meta, dim**-0.5)
    got = paged_attention(query, cache.key, cache.value, meta, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# A 16- or 8-bit cache against the fp32 one, written from the same fp32 K/V (random normal,
# head dim 64, scale 1/8): the error is the rounding of K and V (fp16: 2^-11 relative,
# bf16: 2^-8, int8: half a step of max|row| / 127, at most a step at the one code of a
# group that moved to carry a bit of the row's scale), carried through softmax and the
# weighted sum. Measured max |diff| here: fp16 9.8e-4, bf16 7.3e-3, int8 2.3e-2 (kernels
# and reference alike; 1.7e-2 when int8 rows kept an fp32 scale beside their codes); the
# bounds leave 2-3x of room.
KV_BOUNDS = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.int8: 5e-2}


@pytest.mark.parametrize("kv_dtype", sorted(KV_BOUNDS, key=str))
def test_a_narrow_cache_stays_within_its_bound_of_the_fp32_one(kv_dtype):
    seqs = [(1, 1), (1, 600), (7, 7), (5, 37), (20, 100)]
    query, exact, meta = build_case(seqs, 16, heads=9, kv_heads=3)
    _, cache, _ = build_case(seqs, 16, heads=9, kv_heads=3, kv_dtype=kv_dtype)
    rounded = reference.to_cache(exact.key, kv_dtype)
    assert torch.equal(reference.from_cache(cache.key).nan_to_num(),
                       reference.from_cache(rounded).nan_to_num())  # fmt: skip
    want = reference.paged_attention(query, exact.key, exact.value, meta, 0.125)
    for impl in (cpu_attention, reference):
        got = impl.paged_attention(query, cache.key, cache.value, meta, 0.125)
        err = (got - want).abs().max().item()
        assert 0 < err <= KV_BOUNDS[kv_dtype], (impl.__name__, err)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention_is_batch_invariant_bitwise(kv_dtype):
    seqs = [(1, 50), (4, 30), (1, 200)]
    query, cache, meta = build_case(seqs, 16, heads=4, kv_heads=2, kv_dtype=kv_dtype)
    together = paged_attention(query, cache.key, cache.value, meta, 0.125)
    start = 0
    for i, (qlen, ctx) in enumerate(seqs):
        tables = meta.block_tables[i : i + 1, : -(-ctx // 16)].tolist()
        alone = AttentionMetadata.build([qlen], [ctx], tables, 16)
        q = query[start : start + qlen].contiguous()
        got = paged_attention(q, cache.key, cache.value, alone, 0.125)
        assert torch.equal(got, together[start : start + qlen])
        start += qlen


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_query_gives_the_same_bits_decoded_or_in_a_prefill_chunk(kv_dtype):
    """Recomputing a sequence (preemption, a prefix-cache miss) must not change a token: a
    query attends with the same arithmetic alone (decode) as in a prefill chunk, wherever
    the chunk starts and whichever query tile and row block it lands in."""
    ctx, heads, kv_heads = 77, 9, 3
    query, cache, meta = build_case(
        [(ctx, ctx)], 16, heads=heads, kv_heads=kv_heads, kv_dtype=kv_dtype
    )
    table = meta.block_tables[:, : -(-ctx // 16)].tolist()
    prefill = paged_attention(query, cache.key, cache.value, meta, 0.125)
    for qlen in (1, 5, 16, 17, 40):  # a suffix of qlen queries as one chunk
        chunk = AttentionMetadata.build([qlen], [ctx], table, 16)
        got = paged_attention(query[ctx - qlen :].contiguous(), cache.key, cache.value,
                                  chunk, 0.125)  # fmt: skip
        assert torch.equal(got, prefill[ctx - qlen :]), qlen
    for pos in (0, 15, 16, 50, ctx - 1):  # each query decoded alone over its prefix
        alone = AttentionMetadata.build([1], [pos + 1], table, 16)
        got = paged_attention(query[pos : pos + 1].contiguous(), cache.key, cache.value,
                                  alone, 0.125)  # fmt: skip
        assert torch.equal(got, prefill[pos : pos + 1]), pos


@pytest.mark.parametrize("fmt", REGROUPED)
@pytest.mark.parametrize("cols", [32, 64, 576])
@pytest.mark.parametrize("rows", [1, 16, 21])  # one partial tile, one whole, one and a part
def test_tiled_layout_holds_the_same_weights(fmt, cols, rows):
    plain = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, cols, seed=cols), cols)
    tiled = plain.tiled()
    padded = -(-rows // 16) * 16
    assert tiled.tiled_layout and tiled.data.shape == (padded, plain.data.shape[1])
    assert tiled.shape == plain.shape
    assert torch.equal(tiled.codes(), plain.codes())
    assert torch.equal(tiled.scales(), plain.scales())
    assert torch.equal(tiled.dequantize(), plain.dequantize())
    assert torch.equal(dequantize_rows(tiled), plain.dequantize())
    picked = torch.tensor([rows - 1, 0, rows - 1], dtype=torch.int64)
    assert torch.equal(dequantize_rows(tiled, picked), plain.dequantize()[picked])
    if rows > 1:
        assert not torch.equal(tiled.data[:rows], plain.data), "rows are interleaved"
    with pytest.raises(ValueError, match="tiled layout"):
        tiled.take_rows(picked)


@pytest.mark.parametrize("fmt", REGROUPED)
@pytest.mark.parametrize("n", [1, 3, 8, 15, 100])  # register tiles of 8 rows + the rest
@pytest.mark.parametrize("cols", [32, 576])
@pytest.mark.parametrize("rows", [13, 37])  # a partial tile; two whole ones and a partial
def test_int8_linear_is_the_exact_product_of_quantized_activations(fmt, n, cols, rows):
    plain = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, cols, seed=n + cols), cols)
    weight = plain.tiled()
    x = torch.randn(n, cols)
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros, not NaN
    bias = torch.randn(rows)
    expected = quantize_activations(x).double() @ weight.dequantize().double().T + bias
    got = quant_linear(x, weight, bias, int8=True)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5)
    # ... and close to the fp32 product: int8 activations cost ~0.4% per element.
    exact = x.double() @ weight.dequantize().double().T + bias
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.02


def test_int8_linear_rows_do_not_depend_on_the_batch():
    weight = QuantizedWeight.from_gguf("q4_1", random_blocks("q4_1", 40, 576), 576).tiled()
    x = torch.randn(150, 576)  # more than one 64-row tile of inputs
    whole = quant_linear(x, weight, int8=True)
    for n in (1, 2, 4, 5, 8, 9, 17, 70):
        assert torch.equal(quant_linear(x[:n].contiguous(), weight, int8=True), whole[:n])


def _isa_library(isa: str):
    """The kernels built for `isa` (this CPU must run it), with the int8 linear's signature."""
    import ctypes

    from kernels.cpu import build as cpu_build

    lib = ctypes.CDLL(str(cpu_build.build(isa)))
    lib.hr_quant_linear_int8.argtypes = SIGNATURES["hr_quant_linear_int8"]
    lib.hr_quant_linear_int8.restype = None
    return lib


def test_int8_linear_gives_the_same_bits_on_every_isa():
    """VNNI, AVX-512 without it (maddubs, Q8_0 split in nibbles) and AVX2 (two halves) all
    sum the same exact integers and run the same float operations in the same order."""
    from kernels.cpu import build as cpu_build

    flags = cpu_build.cpu_flags()
    runnable = [isa for isa, (_, need) in cpu_build.ISA_LEVELS.items() if set(need) <= flags]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable}")
    x = torch.randn(11, 576)
    x[3] *= 1e3  # large activations: codes at +-127 against Q8_0's +-127
    for fmt in REGROUPED:
        weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 37, 576, seed=7), 576).tiled()
        bias = torch.randn(37)
        outs = []
        for isa in runnable:
            out = torch.empty(11, 37)
            _isa_library(isa).hr_quant_linear_int8(
                weight.format.code, x.data_ptr(), 11, 576, weight.data.data_ptr(), 37,
                out.data_ptr(), bias.data_ptr(),
            )  # fmt: skip
            outs.append(out)
        for isa, out in zip(runnable[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), f"{fmt}: {isa} differs from {runnable[0]}"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_attention_gives_the_same_bits_on_every_isa(kv_dtype):
    """The AVX-512 transpose and the AVX2 build's scalar one feed the same fused
    multiply-adds in the same order."""
    from kernels.cpu import build as cpu_build

    flags = cpu_build.cpu_flags()
    runnable = [isa for isa, (_, need) in cpu_build.ISA_LEVELS.items() if set(need) <= flags]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable}")
    query, cache, meta = build_case(
        [(1, 40), (20, 100), (3, 3)], 16, heads=8, kv_heads=2, kv_dtype=kv_dtype
    )
    outs = []
    for isa in runnable:
        lib = _isa_library(isa)
        lib.hr_paged_attention.argtypes = SIGNATURES["hr_paged_attention"]
        lib.hr_paged_attention.restype = None
        out = torch.empty_like(query)
        lib.hr_paged_attention(
            query.data_ptr(), cache.key.data_ptr(), cache.value.data_ptr(),
            meta.block_tables.data_ptr(), meta.context_lens.data_ptr(),
            meta.query_start_loc.data_ptr(), meta.num_seqs, 8, 2, 64, 16,
            meta.block_tables.shape[1], 0.125, out.data_ptr(), KV_DTYPE_CODES[kv_dtype],
            0, 0.0,
        )  # fmt: skip
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    for isa, out in zip(runnable[1:], outs[1:], strict=True):
        assert torch.equal(out, outs[0]), f"{isa} differs from {runnable[0]}"


# --- sliding window and soft-capped scores (Mistral, Gemma 2/3) ---------------------------


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_windowed_and_capped_attention_matches_reference(window, softcap, kv_dtype):
    seqs = [(1, 1), (1, 15), (1, 600), (7, 7), (1, 40), (5, 37), (20, 100), (33, 33)]
    query, cache, meta = build_case(seqs, 16, heads=9, kv_heads=3, kv_dtype=kv_dtype)
    query = query * 4  # scores of several units, so the cap bends them
    scale = 64**-0.5
    expected = reference.paged_attention(query, cache.key, cache.value, meta, scale,
                                         window, softcap)  # fmt: skip
    got = paged_attention(query, cache.key, cache.value, meta, scale, True, window, softcap)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    unmasked = reference.paged_attention(query, cache.key, cache.value, meta, scale)
    assert not torch.allclose(expected, unmasked)  # the window or the cap changed something


def test_reference_window_is_the_last_keys_by_absolute_position():
    """A window of W: the query at position p attends to keys p - W + 1..p, exactly as full
    attention over those keys alone."""
    ctx, window = 50, 8
    query, cache, meta = build_case([(ctx, ctx)], 16, heads=2, kv_heads=1)
    got = reference.paged_attention(query, cache.key, cache.value, meta, 0.125, window)
    keys = reference.from_cache(cache.key.view(-1, 1, 64))
    values = reference.from_cache(cache.value.view(-1, 1, 64))
    slots = [int(meta.block_tables[0, p // 16]) * 16 + p % 16 for p in range(ctx)]
    for p in (0, 7, 8, 30, ctx - 1):
        seen = slots[max(0, p - window + 1) : p + 1]
        k, v = keys[seen, 0], values[seen, 0]
        weights = torch.softmax(query[p] @ k.T * 0.125, dim=-1)
        torch.testing.assert_close(got[p], weights @ v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (16, None), (21, 30.0), (None, 30.0)])
def test_windowed_query_gives_the_same_bits_decoded_or_in_a_prefill_chunk(window, softcap):
    ctx = 77
    query, cache, meta = build_case([(ctx, ctx)], 16, heads=9, kv_heads=3)
    table = meta.block_tables[:, : -(-ctx // 16)].tolist()
    args = (0.125, True, window, softcap)
    prefill = paged_attention(query, cache.key, cache.value, meta, *args)
    for qlen in (1, 5, 16, 17, 40):
        chunk = AttentionMetadata.build([qlen], [ctx], table, 16)
        got = paged_attention(query[ctx - qlen :].contiguous(), cache.key, cache.value,
                                  chunk, *args)  # fmt: skip
        assert torch.equal(got, prefill[ctx - qlen :]), qlen
    for pos in (0, 4, 15, 16, 50, ctx - 1):
        alone = AttentionMetadata.build([1], [pos + 1], table, 16)
        got = paged_attention(query[pos : pos + 1].contiguous(), cache.key, cache.value,
                                  alone, *args)  # fmt: skip
        assert torch.equal(got, prefill[pos : pos + 1]), pos


# --- long contexts: keys in fixed partitions of 256, split across threads (split-K) ---------

PART = 256  # attention.cpp kPart


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (300, None), (None, 30.0)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_long_context_attention_matches_reference(window, softcap, kv_dtype):
    """Contexts over several partitions (decode and prefill rows, windows crossing partition
    boundaries) against the reference's one softmax."""
    seqs = [(1, 3 * PART + 7), (40, 2 * PART + 40), (1, PART), (1, PART + 1), (3, 5 * PART)]
    query, cache, meta = build_case(seqs, 16, heads=9, kv_heads=3, kv_dtype=kv_dtype)
    query = query * 2
    scale = 64**-0.5
    expected = reference.paged_attention(query, cache.key, cache.value, meta, scale,
                                         window, softcap)  # fmt: skip
    got = paged_attention(query, cache.key, cache.value, meta, scale, True, window, softcap)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (300, None), (PART, 30.0)])
def test_long_context_query_gives_the_same_bits_decoded_or_in_a_prefill_chunk(window, softcap):
    """Past one partition too, whatever tile, row form or chunk start a query lands in."""
    ctx = 3 * PART + 37
    query, cache, meta = build_case([(ctx, ctx)], 16, heads=9, kv_heads=3)
    table = meta.block_tables[:, : -(-ctx // 16)].tolist()
    args = (0.125, True, window, softcap)
    prefill = paged_attention(query, cache.key, cache.value, meta, *args)
    for qlen in (1, 7, 17, 300):
        chunk = AttentionMetadata.build([qlen], [ctx], table, 16)
        got = paged_attention(query[ctx - qlen :].contiguous(), cache.key, cache.value,
                                  chunk, *args)  # fmt: skip
        assert torch.equal(got, prefill[ctx - qlen :]), qlen
    for pos in (PART - 1, PART, PART + 1, 2 * PART + 100, ctx - 1):
        alone = AttentionMetadata.build([1], [pos + 1], table, 16)
        got = paged_attention(query[pos : pos + 1].contiguous(), cache.key, cache.value,
                                  alone, *args)  # fmt: skip
        assert torch.equal(got, prefill[pos : pos + 1]), pos


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_split_k_gives_the_bits_of_one_thread_and_of_a_full_batch(window, kv_dtype):
    """A few long sequences are split per partition across threads (split-K) and folded
    after; the result must be the bits one thread computes item by item, and those of the
    same sequences in a batch big enough not to be split."""
    seqs = [(1, 4 * PART + 3), (2, 2 * PART + 9)]  # 6 items: split on 2 threads or more
    filler = [(1, 100)] * 6  # + 18 items: not split
    query, cache, meta = build_case(seqs + filler, 16, heads=9, kv_heads=3, kv_dtype=kv_dtype)
    rows = sum(q for q, _ in seqs)
    widths = [-(-ctx // 16) for _, ctx in seqs]
    tables = [meta.block_tables[i, : widths[i]].tolist() for i in range(len(seqs))]
    few = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, 16)
    q = query[:rows].contiguous()
    args = (0.125, True, window, None)
    lib = library()
    try:
        lib.hr_set_num_threads(1)
        one_thread = paged_attention(q, cache.key, cache.value, few, *args)
        lib.hr_set_num_threads(2)
        split = paged_attention(q, cache.key, cache.value, few, *args)
        batch = paged_attention(query, cache.key, cache.value, meta, *args)
    finally:
        use_torch_threads()
    assert not torch.isnan(split).any()
    assert torch.equal(split, one_thread)
    assert torch.equal(split, batch[:rows])


@pytest.mark.parametrize("case", ["random", "ties", "masked", "all_masked", "nan", "inf"])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (48, 1000), (3, 17), (70, 5)])
def test_argmax_rows_gives_torch_argmax(case, rows, vocab):
    """Greedy sampling's argmax: torch's ids exactly, ties to the lowest id, a NaN first."""
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    mask = torch.rand(rows, vocab, generator=g) < 0.02
    if case == "ties":
        x = torch.round(x)
    elif case == "masked":
        x[:, ::3] = float("-inf")
    elif case == "all_masked":
        x[:] = float("-inf")
    elif case == "nan":
        x[mask] = float("nan")
    elif case == "inf":
        x[mask] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_gelu_tanh_mul_matches_torch():
    gate_up = torch.randn(5, 96) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(gelu_tanh_mul(gate_up), want, rtol=1e-5, atol=1e-5)


def test_head_rms_norm_normalises_each_head_in_place():
    """Per-head q/k RMSNorm (Qwen3, Gemma 3) on the q or k columns of a fused qkv row."""
    heads, kv_heads, dim, tokens = 4, 2, 32, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    weight = torch.rand(dim) + 0.5
    want = qkv.clone()
    part = want[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    part.copy_(weight * part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + 1e-6))
    head_rms_norm(qkv, weight, heads * dim, kv_heads, 1e-6)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-6)

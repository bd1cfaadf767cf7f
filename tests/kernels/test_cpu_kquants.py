"""The exact kernels over the formats kept in the file's own blocks (Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS: kernels/cpu/quant.py ``file_order``) against gguf's numpy dequantization.

Random blocks (finite fp16 d / dmin, random codes and packed scales) of every type:
the kernels' expansion is bit-identical to gguf.quants.dequantize; the products match the
dense product of those weights for one row (decode) and many (prefill), odd row counts,
and give the same bits on every ISA this CPU runs and for any batch around a row.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu.library import SIGNATURES, available, library
from kernels.cpu.quant import FORMATS, QuantizedWeight
from kernels.cpu.quant_linear import dequantize_rows, quant_linear, quantize_activations

pytestmark = pytest.mark.skipif(not available(), reason="CPU kernels cannot be built here")

GGUF_TYPES = {
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL,
    "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS,
}
# Byte offsets of each block's fp16 fields (d, and m or dmin).
HALVES = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
          "iq4_nl": (0,), "iq4_xs": (0,)}  # fmt: skip


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid GGUF blocks of `fmt`: finite fp16 fields, every other byte random."""
    g = torch.Generator().manual_seed(seed)
    f = FORMATS[fmt]
    nb = cols // f.block_values
    raw = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=g)
    # K-quant d and dmin multiply 6-bit (Q6_K: 8-bit) scales: smaller, so the weights are
    # of the size of the other formats' (and some fp16 subnormals are among them).
    span = 0.001 if f.block_values == 256 else 0.02
    for offset in HALVES[fmt]:
        half = ((torch.rand(rows, nb, generator=g) - 0.5) * span).half()
        raw[:, :, offset : offset + 2] = half.view(torch.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def gguf_weights(fmt: str, blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = gguf.quants.dequantize(blocks.numpy(), GGUF_TYPES[fmt]).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(out))


def widths(fmt: str) -> list[int]:
    return [256, 768] if FORMATS[fmt].block_values == 256 else [96, 576]


@pytest.mark.parametrize("fmt", sorted(GGUF_TYPES))
def test_weights_dequantize_bit_exact_to_gguf(fmt):
    for cols in widths(fmt):
        rows = 7
        blocks = random_blocks(fmt, rows, cols, seed=cols)
        expected = gguf_weights(fmt, blocks, rows, cols)
        weight = QuantizedWeight.from_gguf(fmt, blocks, cols)
        assert weight.nbytes == blocks.numel(), "kept as the file's bytes"
        assert torch.equal(weight.dequantize(), expected)
        assert torch.equal(dequantize_rows(weight), expected)
        picked = torch.tensor([5, 0, 5, 6], dtype=torch.int64)
        assert torch.equal(dequantize_rows(weight, picked), expected[picked])


@pytest.mark.parametrize("fmt", sorted(GGUF_TYPES))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 13, 100])
def test_linear_matches_the_dense_product(fmt, n):
    cols = widths(fmt)[1]
    rows = 4 * 9 + 3  # a tail of rows that is not a multiple of 4
    blocks = random_blocks(fmt, rows, cols, seed=n)
    weight = QuantizedWeight.from_gguf(fmt, blocks, cols)
    dense = gguf_weights(fmt, blocks, rows, cols)
    x = torch.randn(n, cols)
    bias = torch.randn(rows)
    expected = x.double() @ dense.double().T + bias.double()
    got = quant_linear(x, weight, bias)
    assert got.shape == (n, rows)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # Bit-identical to the gguf weights' dense product summed in the kernels' order: the
    # kernel adds nothing to the exact expansion.
    assert torch.equal(got, _kernel_order_product(dense, x, bias))


def _kernel_order_product(dense: torch.Tensor, x: torch.Tensor, bias: torch.Tensor):
    """x @ dense.T + bias in fp32, summed as every exact kernel sums (quant_linear.cpp):
    lane i of 16 accumulates k = i, i + 16, ... by fused multiply-adds (the compiler
    contracts them: emulated in float64, where the product is exact, then rounded once
    more), the 16 lanes by pairwise halving, then the bias."""
    w = dense.reshape(dense.shape[0], -1, 16).double()
    xs = x.reshape(x.shape[0], -1, 16).double()
    acc = torch.zeros(x.shape[0], dense.shape[0], 16)
    for c in range(w.shape[1]):
        acc = (xs[:, None, c] * w[None, :, c] + acc.double()).float()
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0] + bias


@pytest.mark.parametrize("fmt", sorted(GGUF_TYPES))
def test_rows_do_not_depend_on_the_batch(fmt):
    cols = widths(fmt)[1]
    weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 21, cols), cols)
    x = torch.randn(40, cols)
    whole = quant_linear(x, weight)
    for n in (1, 2, 5, 6, 11):
        assert torch.equal(quant_linear(x[:n].contiguous(), weight), whole[:n])


def test_the_same_bits_on_every_isa():
    flags = cpu_build.cpu_flags()
    runnable = [isa for isa, (_, need) in cpu_build.ISA_LEVELS.items() if set(need) <= flags]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable}")
    for fmt in sorted(GGUF_TYPES):
        cols = widths(fmt)[1]
        weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 37, cols, seed=3), cols)
        bias = torch.randn(37)
        for n in (1, 11):
            x = torch.randn(n, cols)
            outs = []
            for isa in runnable:
                lib = ctypes.CDLL(str(cpu_build.build(isa)))
                fn = lib.hr_quant_linear
                fn.argtypes, fn.restype = SIGNATURES["hr_quant_linear"], None
                out = torch.empty(n, 37)
                fn(
                    weight.format.code, x.data_ptr(), n, cols, weight.data.data_ptr(), 37,
                    out.data_ptr(), bias.data_ptr(),
                )  # fmt: skip
                outs.append(out)
            for isa, out in zip(runnable[1:], outs[1:], strict=True):
                assert torch.equal(out, outs[0]), f"{fmt}: {isa} differs from {runnable[0]}"


def test_k_quants_need_whole_super_blocks_and_iq4_has_an_int8_layout():
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight.from_gguf("q4_k", random_blocks("q4_k", 2, 256)[:, :72], 128)
    for fmt in ("iq4_nl", "iq4_xs"):
        weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 2, 256), 256)
        tiled = weight.tiled()
        assert tiled.format.name == fmt and tiled.tiled_layout


def test_stacked_weights_of_different_formats():
    """q|k|v of a Q4_K_M layer: Q4_K rows over Q6_K rows, each part in its own format."""
    parts = [
        QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, 512, seed=rows), 512)
        for fmt, rows in (("q4_k", 13), ("q4_k", 6), ("q6_k", 6))
    ]
    parts.append(QuantizedWeight.from_gguf("q8_0", _q8_0_blocks(3, 512), 512))
    stacked = QuantizedWeight.stack(parts)
    assert stacked.shape == (28, 512) and stacked.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    bias = torch.randn(28)
    for n in (1, 3, 9):
        x = torch.randn(n, 512)
        alone = torch.cat([quant_linear(x, p) for p in parts], dim=1) + bias
        assert torch.equal(quant_linear(x, stacked, bias), alone)
    # tiled() tiles part by part: the same stack as tiling the parts, then stacking them.
    tiled = stacked.tiled()
    assert [p.format.name for p in tiled.parts] == ["q4_k", "q4_k", "q6_k", "q8_0"]
    assert torch.equal(tiled.dequantize(), stacked.dequantize())
    _assert_stack_computes_as_its_parts(tiled, [p.tiled() for p in parts])


def test_stacked_tiled_weights_for_the_int8_kernel():
    """q|k|v whose parts differ in format (Q5_0 q and k beside a Q8_0 or Q6_K v), each in
    its tiled layout: the int8 kernel computes each part into its own columns, the same
    bits as each part alone (its tiles padded apart, the bias added per part)."""
    parts = [
        QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, 512, seed=rows), 512)
        for fmt, rows in (("q5_0", 13), ("q6_k", 6), ("q5_0", 20))
    ]
    parts.insert(2, QuantizedWeight.from_gguf("q8_0", _q8_0_blocks(3, 512), 512))
    tiled = [p.for_int8().tiled() for p in parts]
    stacked = QuantizedWeight.stack(tiled)
    assert stacked.tiled_layout and stacked.for_int8().tiled() is stacked
    assert stacked.shape == (42, 512) and stacked.nbytes == sum(p.nbytes for p in tiled)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    _assert_stack_computes_as_its_parts(stacked, tiled)
    with pytest.raises(ValueError, match="one layout"):
        QuantizedWeight.stack([parts[0], tiled[1]])


def test_stacked_tiled_q4_k_beside_q6_k_for_the_int8_kernel():
    """The fused q|k|v of a Q4_K_M layer in int8 mode: Q4_K q over Q6_K k and a Q5_K v
    (and a Q8_0 part), each tiled in its own layout, none converted: the int8 kernel
    computes each part into its own columns, the same bits as each part alone."""
    parts = [
        QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, 512, seed=rows), 512)
        for fmt, rows in (("q4_k", 21), ("q6_k", 6), ("q5_k", 7))
    ]
    parts.append(QuantizedWeight.from_gguf("q8_0", _q8_0_blocks(3, 512), 512))
    tiled = [p.for_int8().tiled() for p in parts]
    assert [p.format.name for p in tiled] == ["q4_k", "q6_k", "q5_k", "q8_0"]
    stacked = QuantizedWeight.stack(tiled)
    assert stacked.shape == (37, 512) and stacked.nbytes == sum(p.nbytes for p in tiled)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    _assert_stack_computes_as_its_parts(stacked, tiled)


def test_q4_k_as_q4_1_is_the_old_int8_conversion():
    """as_q4_1 (bench/kquant_pass.py's baseline): the same nibbles, each block's d * sc and
    -dmin * m rounded to fp16; the weights move by that rounding only."""
    plain = QuantizedWeight.from_gguf("q4_k", random_blocks("q4_k", 9, 512), 512)
    old = plain.as_q4_1()
    assert old.format.name == "q4_1" and old.nbytes == 9 * 16 * 20
    w, w1 = plain.dequantize(), old.dequantize()
    sc, mn, d, dmin = plain.q4_k_scales()
    scale = (d.float().repeat_interleave(8, 1) * sc.float()).unsqueeze(-1)
    offset = (dmin.float().repeat_interleave(8, 1) * mn.float()).unsqueeze(-1)
    # fp16's half ulp of both terms (2^-25 absolute below fp16's normal range)
    bound = (scale.abs() * 15 + offset.abs()) * 2**-11 + 16 * 2**-25 + 1e-7
    assert ((w1 - w).reshape(9, -1, 32).abs() <= bound).all()
    with pytest.raises(ValueError, match="per-row Q4_K"):
        plain.tiled().as_q4_1()


def _q8_0_blocks(rows: int, cols: int) -> torch.Tensor:
    array = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    return torch.from_numpy(gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("fmt", sorted(GGUF_TYPES))
@pytest.mark.parametrize("n", [1, 9])
def test_int8_mode_keeps_every_format_within_the_bound(fmt, n):
    """for_int8: every format kept (the int8 kernel reads its tiled layout, as many bytes
    as the file's blocks; IQ4_NL and IQ4_XS are no longer requantized to Q8_0); the int8
    product stays within 2% (norm) of the exact kernel's on the file's weights, the bound
    the int8 tests of the other formats state."""
    cols = widths(fmt)[1]
    plain = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 37, cols, seed=n), cols)
    converted = plain.for_int8()
    assert converted is plain and converted.tiled().nbytes == 48 * plain.data.shape[1]
    assert torch.equal(converted.tiled().dequantize(), plain.dequantize())
    x = torch.randn(n, cols)
    x[0, :32] = 0.0
    got = quant_linear(x, converted.tiled(), int8=True)
    exact = quant_linear(x, plain)
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


# Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS in the int8 kernel's own tiled layouts
# (quant_linear_int8.cpp): the low nibbles as Q4_0's tiles, then Q5_0's plane of 5th bits
# and d (Q5_1: d and m), Q4_K's 6-bit scales
# and mins and d, dmin (Q5_K: with Q5_0's plane), or Q6_K's 2 vectors of top bits, int8
# sub-block scales and d; IQ4_NL's table indices as Q4_0's nibbles and d, IQ4_XS's with
# its packed 6-bit scales and d per super-block; as many bytes as the file's blocks.
NATIVE_INT8 = ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
LAYOUT_WIDTHS = {"q5_0": [32, 64, 576], "q5_1": [32, 64, 576], "q4_k": [256, 512, 768],
                 "q5_k": [256, 512, 768], "q6_k": [256, 512, 768], "iq4_nl": [32, 64, 576],
                 "iq4_xs": [256, 512, 768]}  # fmt: skip
CODE_MAX = {"q5_0": 31, "q5_1": 31, "q4_k": 15, "q5_k": 31, "q6_k": 63, "iq4_nl": 15,
            "iq4_xs": 15}  # fmt: skip


@pytest.mark.parametrize("fmt", NATIVE_INT8)
@pytest.mark.parametrize("width", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 16, 21])  # one partial tile, one whole, one and a part
def test_native_int8_tiled_layout_holds_the_same_weights(fmt, width, rows):
    cols = LAYOUT_WIDTHS[fmt][width]
    f = FORMATS[fmt]
    blocks = random_blocks(fmt, rows, cols, seed=cols + rows)
    plain = QuantizedWeight.from_gguf(fmt, blocks, cols)
    tiled = plain.tiled()
    padded = -(-rows // 16) * 16
    assert tiled.tiled_layout and tiled.data.shape == (
        padded,
        cols // f.block_values * f.block_bytes,
    )
    codes = plain.codes()
    assert codes.max() <= CODE_MAX[fmt] and torch.equal(tiled.codes(), codes)
    if fmt in ("q5_0", "q5_1", "iq4_nl"):
        assert tiled.scales().shape == (rows, 2 if fmt == "q5_1" else 1, cols // 32)
        assert torch.equal(tiled.scales(), plain.scales())
    elif fmt == "iq4_xs":
        scales = plain.iq4_xs_scales()
        assert int(scales[0].max()) <= 63
        assert all(map(torch.equal, tiled.iq4_xs_scales(), scales))
    elif fmt in ("q4_k", "q5_k"):
        scales = plain.q4_k_scales()
        assert max(int(v.max()) for v in scales[:2]) <= 63
        assert all(map(torch.equal, tiled.q4_k_scales(), scales))
    else:
        assert all(map(torch.equal, tiled.q6_k_scales(), plain.q6_k_scales()))
    expected = gguf_weights(fmt, blocks, rows, cols)
    assert torch.equal(tiled.dequantize(), expected)
    assert torch.equal(dequantize_rows(tiled), expected)
    picked = torch.tensor([rows - 1, 0, rows - 1], dtype=torch.int64)
    assert torch.equal(dequantize_rows(tiled, picked), expected[picked])
    if fmt == "q5_0":
        assert torch.equal(plain.as_q8_0().dequantize(), expected), "Q5_0 -> Q8_0 is exact"
    with pytest.raises(ValueError, match="tiled layout"):
        tiled.take_rows(picked)


@pytest.mark.parametrize("fmt", NATIVE_INT8)
@pytest.mark.parametrize("n", [1, 3, 8, 15, 100])  # register tiles of 8 rows + the rest
@pytest.mark.parametrize("width", [0, 1])
@pytest.mark.parametrize("rows", [13, 37])  # a partial tile; two whole ones and a partial
def test_native_int8_is_the_exact_product_of_quantized_activations(fmt, n, width, rows):
    """Against the float reference of the same numerics: activations quantized per block
    of 32 as the kernel does, the file's weights (Q5_0: codes 0..31 with m = -16 d; Q5_1:
    codes 0..31 with its m; Q4_K:
    codes 0..15 (Q5_K 0..31), d * sc * q - dmin * m per block of 32; Q6_K: codes 0..63,
    (q - 32) * d * sc per half-block of 16; IQ4_NL: d * v[q], IQ4_XS: d * (ls - 32) * v[q]
    per block of 32, v llama.cpp's table of 16 values)."""
    cols = [LAYOUT_WIDTHS[fmt][0], 576 if fmt == "q5_0" else 1536][width]
    blocks = random_blocks(fmt, rows, cols, seed=n + cols)
    weight = QuantizedWeight.from_gguf(fmt, blocks, cols).tiled()
    x = torch.randn(n, cols)
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros, not NaN
    bias = torch.randn(rows)
    dense = gguf_weights(fmt, blocks, rows, cols).double()
    expected = quantize_activations(x).double() @ dense.T + bias
    got = quant_linear(x, weight, bias, int8=True)
    scale = expected.abs().max().item()
    # fp32 rounding of sums as large as the outputs (the K-quants' random scales make them
    # ~50)
    atol = 2e-5 if fmt == "q5_0" else 2e-5 * scale
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=atol)
    exact = x.double() @ dense.T + bias
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("fmt", NATIVE_INT8)
def test_native_int8_rows_do_not_depend_on_the_batch(fmt):
    cols = 576 if fmt == "q5_0" else 768
    weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 40, cols), cols).tiled()
    x = torch.randn(150, cols)  # more than one 64-row tile of inputs
    whole = quant_linear(x, weight, int8=True)
    for n in range(1, 71):
        assert torch.equal(quant_linear(x[:n].contiguous(), weight, int8=True), whole[:n])
    for j in (0, 9, 64, 149):  # one row alone, wherever it sat in the batch
        alone = quant_linear(x[j : j + 1].contiguous(), weight, int8=True)
        assert torch.equal(alone, whole[j : j + 1])


@pytest.mark.parametrize("fmt", NATIVE_INT8)
def test_native_int8_gives_the_same_bits_on_every_isa(fmt):
    """VNNI, AVX-512 without it (maddubs: 63 * 127 * 2 fits int16; IQ4's codes up to 241
    split in nibbles as Q8_0's) and AVX2 (the top bits spread from 32-bit halves, two
    8-lane halves; Q4_K's scales and mins, IQ4_XS's scales unpacked in two 8-lane halves)
    sum the same exact integers in the same order."""
    flags = cpu_build.cpu_flags()
    runnable = [isa for isa, (_, need) in cpu_build.ISA_LEVELS.items() if set(need) <= flags]
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs only {runnable}")
    cols = 576 if fmt == "q5_0" else 768
    weight = QuantizedWeight.from_gguf(fmt, random_blocks(fmt, 37, cols, seed=7), cols)
    weight = weight.tiled()
    bias = torch.randn(37)
    for n in (1, 11):
        x = torch.randn(n, cols)
        x[0] *= 1e3  # large activations: codes at +-127
        outs = []
        for isa in runnable:
            lib = ctypes.CDLL(str(cpu_build.build(isa)))
            fn = lib.hr_quant_linear_int8
            fn.argtypes, fn.restype = SIGNATURES["hr_quant_linear_int8"], None
            out = torch.empty(n, 37)
            fn(
                weight.format.code, x.data_ptr(), n, cols, weight.data.data_ptr(), 37,
                out.data_ptr(), bias.data_ptr(),
            )  # fmt: skip
            outs.append(out)
        for isa, out in zip(runnable[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), f"{fmt}: {isa} differs from {runnable[0]}"


@pytest.mark.parametrize("fmt", [*NATIVE_INT8, "q4_0", "q4_1", "q8_0"])
def test_native_int8_gives_the_bits_of_the_16_lane_form(fmt):
    """The kernel each ISA runs against tile_dot's 16-lane form built for the same ISA
    (hr_quant_linear_int8_tile16): AVX2's passes of 8 rows, int16 sums, grouped activations
    and Q6_K scales inside the madds give the same bits, on every row count (4 at a time,
    then 1-3 in one pass), partial tiles, large activations and a bias. (AVX-512 runs that
    form itself; the ISAs against each other: the test above, where a CPU runs several.)"""
    lib = library()
    cols = 576 if fmt in ("q5_0", "q5_1", "iq4_nl", "q4_0", "q4_1", "q8_0") else 768
    for rows in (13, 37):
        if fmt == "q8_0":
            blocks = _q8_0_blocks(rows, cols)
        elif fmt in ("q4_0", "q4_1"):
            from tests.kernels.test_cpu_kernels import random_blocks as regrouped_blocks

            blocks = regrouped_blocks(fmt, rows, cols, seed=rows)
        else:
            blocks = random_blocks(fmt, rows, cols, seed=rows)
        weight = QuantizedWeight.from_gguf(fmt, blocks, cols).for_int8().tiled()
        bias = torch.randn(rows)
        for n in (1, 2, 3, 4, 5, 6, 7, 9, 70):
            x = torch.randn(n, cols)
            x[0] *= 1e3  # codes at +-127
            got, want = torch.empty(n, rows), torch.empty(n, rows)
            for fn, out in ((lib.hr_quant_linear_int8, got),
                            (lib.hr_quant_linear_int8_tile16, want)):  # fmt: skip
                fn(weight.format.code, x.data_ptr(), n, cols, weight.data.data_ptr(), rows,
                   out.data_ptr(), bias.data_ptr())  # fmt: skip
            assert torch.equal(got, want), f"{fmt}: {rows} rows, {n} inputs"


def test_stacked_tiled_iq4_parts_for_the_int8_kernel():
    """The fused q|k|v of an IQ4_XS file in int8 mode: IQ4_XS q over IQ4_NL k and v (rows
    that are not multiples of 256 fall back to IQ4_NL) beside a Q8_0 and a Q5_K part, each
    tiled in its own layout, none requantized: each part's columns the same bits as alone."""
    parts = [
        QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, 512, seed=rows), 512)
        for fmt, rows in (("iq4_xs", 21), ("iq4_nl", 6), ("iq4_nl", 7), ("q5_k", 5))
    ]
    parts.append(QuantizedWeight.from_gguf("q8_0", _q8_0_blocks(3, 512), 512))
    tiled = [p.for_int8().tiled() for p in parts]
    assert [p.format.name for p in tiled] == ["iq4_xs", "iq4_nl", "iq4_nl", "q5_k", "q8_0"]
    stacked = QuantizedWeight.stack(tiled)
    assert stacked.shape == (42, 512) and stacked.nbytes == sum(p.nbytes for p in tiled)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    _assert_stack_computes_as_its_parts(stacked, tiled)
    # A stack of per-row parts tiles part by part, into the same stack.
    per_row = QuantizedWeight.stack([p.for_int8() for p in parts]).tiled()
    assert [p.format.name for p in per_row.parts] == [p.format.name for p in tiled]
    assert torch.equal(per_row.dequantize(), stacked.dequantize())
    _assert_stack_computes_as_its_parts(per_row, tiled)


def _assert_stack_computes_as_its_parts(stacked: QuantizedWeight, tiled: list) -> None:
    """The int8 kernel on a stack of tiled parts: each part's columns the same bits (bias
    included) as the part alone, for 1 to 70 input rows."""
    bias = torch.randn(stacked.rows)
    for n in (1, 3, 9, 70):
        x = torch.randn(n, stacked.cols)
        alone, r = [], 0
        for p in tiled:
            alone.append(quant_linear(x, p, bias[r : r + p.rows].contiguous(), int8=True))
            r += p.rows
        assert torch.equal(quant_linear(x, stacked, bias, int8=True), torch.cat(alone, 1))

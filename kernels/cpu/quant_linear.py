"""Launchers of the quantized linear kernels (kernels/csrc/cpu/quant_linear.cpp, exact fp32;
quant_linear_int8.cpp, int8 activations) and of the row dequantization both provide."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu.library import check_tensor, library
from kernels.cpu.quant import QuantizedWeight


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
        check_tensor("x", x, torch.float32, (None, weight.cols))
        if weight.tiled_layout != int8:
            layout = "tiled (weight.tiled())" if int8 else "per-row"
            raise ValueError(
                f"weight: the {'int8' if int8 else 'fp32'} kernel reads the {layout} layout"
            )
        if bias is not None:
            check_tensor("bias", bias, torch.float32, (weight.rows,))
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
        check_tensor("rows", rows, torch.int64, (None,))
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

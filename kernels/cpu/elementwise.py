"""Launchers of the row-wise kernels (kernels/csrc/cpu/elementwise.cpp): RMSNorm (alone,
after a residual add, per head), the gated activations, the rows' argmax."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu.library import check_tensor, library


def rms_norm(x: Tensor, weight: Tensor, eps: float, check: bool = True) -> Tensor:
    """RMSNorm of each row of x [n, h] (HF LlamaRMSNorm's order)."""
    n, h = x.shape
    if check:
        check_tensor("x", x, torch.float32, (n, h))
        check_tensor("weight", weight, torch.float32, (h,))
    out = torch.empty_like(x)
    library().hr_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n, h, eps)
    return out


def argmax_rows(x: Tensor) -> Tensor:
    """int64 [n]: each row's argmax of x [n, v] (float32), torch.argmax(x, -1)'s answer (the
    lowest of equal ids; a NaN counts as the largest) on every thread."""
    n, v = x.shape
    check_tensor("x", x, torch.float32, (n, v))
    out = torch.empty(n, dtype=torch.int64)
    library().hr_argmax_rows(x.data_ptr(), n, v, out.data_ptr())
    return out


def head_rms_norm(
    qkv: Tensor, weight: Tensor, start: int, heads: int, eps: float, check: bool = True
) -> None:
    """In place: RMSNorm of each of the `heads` head slices that begin at column `start` of
    every row of the fused qkv [T, width], by weight [head_dim] (per-head q/k norms)."""
    tokens, width = qkv.shape
    dim = weight.shape[0]
    if check:
        check_tensor("qkv", qkv, torch.float32, (tokens, width))
        check_tensor("weight", weight, torch.float32, (dim,))
        if dim % 16 or start + heads * dim > width:
            raise ValueError(f"head_rms_norm: {heads} heads of {dim} from {start} in {width}")
    if tokens:
        library().hr_head_rms_norm(
            qkv.data_ptr() + 4 * start, weight.data_ptr(), tokens, width, heads, dim, eps
        )


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, check: bool = True
) -> Tensor:
    """residual += x (in place); returns RMSNorm(residual)."""
    n, h = residual.shape
    if check:
        check_tensor("x", x, torch.float32, (n, h))
        check_tensor("residual", residual, torch.float32, (n, h))
        check_tensor("weight", weight, torch.float32, (h,))
    out = torch.empty_like(x)
    library().hr_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), n, h, eps
    )
    return out


def silu_mul(gate_up: Tensor, check: bool = True) -> Tensor:
    """gate_up [n, 2 * i] -> silu(gate) * up [n, i]."""
    return _gated(gate_up, "hr_silu_mul", check)


def gelu_tanh_mul(gate_up: Tensor, check: bool = True) -> Tensor:
    """gate_up [n, 2 * i] -> gelu_tanh(gate) * up [n, i] (Gemma's GeGLU)."""
    return _gated(gate_up, "hr_gelu_tanh_mul", check)


def _gated(gate_up: Tensor, kernel: str, check: bool) -> Tensor:
    n, width = gate_up.shape
    if check:
        check_tensor("gate_up", gate_up, torch.float32, (n, width))
        if width % 32:
            raise ValueError(f"gate_up: width must be a multiple of 32, got {width}")
    out = torch.empty(n, width // 2, dtype=torch.float32)
    getattr(library(), kernel)(gate_up.data_ptr(), out.data_ptr(), n, width // 2)
    return out

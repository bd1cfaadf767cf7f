"""Weights kept in a GGUF block quantization, packed for the CPU kernels.

A GGUF tensor of a block format stores each run of 32 weights as one block (scales and
codes interleaved). ``QuantizedWeight`` keeps the same bytes, regrouped per row so that
a row's codes are contiguous and its scales follow them (the layout is spelled out at
the top of kernels/csrc/cpu/quant_linear.cpp); nothing is requantized, so every weight
dequantizes to exactly the fp32 value of ``gguf.quants.dequantize``.

``dequantize`` here is the torch reference of that layout (the kernels' test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every supported format


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the kernels' format number
    block_bytes: int  # bytes of one block in the GGUF file
    code_bytes: int  # bytes of codes per block (16: nibbles, 32: int8)
    scale_fields: int  # fp16 values per block after the codes: d, or d and m


FORMATS = {
    "q4_0": BlockFormat("q4_0", 0, 18, 16, 1),
    "q4_1": BlockFormat("q4_1", 1, 20, 16, 2),
    "q8_0": BlockFormat("q8_0", 2, 34, 32, 1),
}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight in a block format; ``data`` is uint8 [rows, row_bytes]."""

    format: BlockFormat
    data: torch.Tensor
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.cols % BLOCK:
            raise ValueError(f"cols must be a multiple of {BLOCK}, got {self.cols}")
        expected = (self.rows, self.cols // BLOCK * self.format.block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"data must be uint8 {expected}, got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_gguf(cls, fmt: str, blocks: torch.Tensor, cols: int) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes (uint8, rows * cols / 32 blocks, row-major)."""
        f = FORMATS[fmt]
        nb = cols // BLOCK
        b = blocks.reshape(-1, nb, f.block_bytes)
        rows = b.shape[0]
        scales = 2 * f.scale_fields
        parts = [b[:, :, scales:].reshape(rows, -1)]  # codes
        parts += [b[:, :, 2 * i : 2 * i + 2].reshape(rows, -1) for i in range(f.scale_fields)]
        return cls(f, torch.cat(parts, dim=1).contiguous(), rows, cols)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (a permutation or selection), in that order."""
        return QuantizedWeight(self.format, self.data[index].contiguous(), len(index), self.cols)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format and width, stacked (fused projections)."""
        first = parts[0]
        if any(p.format != first.format or p.cols != first.cols for p in parts):
            raise ValueError("only weights of one format and width can be stacked")
        data = torch.cat([p.data for p in parts])
        return QuantizedWeight(first.format, data, data.shape[0], first.cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed with torch (reference of the kernels' expansion)."""
        f, nb = self.format, self.cols // BLOCK
        codes = self.data[:, : nb * f.code_bytes].reshape(self.rows, nb, f.code_bytes)
        halves = self.data[:, nb * f.code_bytes :].contiguous().view(torch.float16)
        d = halves[:, :nb].float().unsqueeze(-1)
        if f.code_bytes == 32:  # int8 codes
            return (codes.view(torch.int8).float() * d).reshape(self.rows, self.cols)
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # low nibbles first
        offset = halves[:, nb:].float().unsqueeze(-1) if f.scale_fields == 2 else -8.0 * d
        return (q * d + offset).reshape(self.rows, self.cols)

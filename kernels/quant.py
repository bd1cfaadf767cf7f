"""Weights kept in a GGUF block quantization, packed for the CPU kernels.

A GGUF tensor of a block format stores each run of 32 weights as one block (scales and
codes interleaved). ``QuantizedWeight`` keeps the same bytes, regrouped per row so that
a row's codes are contiguous and its scales follow them (the layout is spelled out at
the top of kernels/csrc/cpu/quant_linear.cpp); nothing is requantized, so every weight
dequantizes to exactly the fp32 value of ``gguf.quants.dequantize``.

The int8 kernel reads a second arrangement of the same bytes, ``grouped()``: the codes of
each run of 8 blocks interleaved 4 at a time (spelled out in quant_linear_int8.cpp), so
one integer dot product per 32 bytes leaves each block's sum in its own lane.

``dequantize`` here is the torch reference of both layouts (the kernels' test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every supported format
GROUP = 8  # blocks per interleaved group of the grouped layout


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
    grouped_layout: bool = False  # codes interleaved per 8 blocks (the int8 kernel's layout)

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
        data = self.data[index].contiguous()
        return QuantizedWeight(self.format, data, len(index), self.cols, self.grouped_layout)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format, width and layout, stacked (fusing)."""
        first = parts[0]
        if any(
            (p.format, p.cols, p.grouped_layout) != (first.format, first.cols, first.grouped_layout)
            for p in parts
        ):
            raise ValueError("only weights of one format, width and layout can be stacked")
        data = torch.cat([p.data for p in parts])
        return QuantizedWeight(first.format, data, data.shape[0], first.cols, first.grouped_layout)

    def grouped(self) -> QuantizedWeight:
        """The same weight in the int8 kernel's layout: each group of 8 blocks (the last one
        holds what is left) with its codes interleaved 4 at a time (quant_linear_int8.cpp)."""
        if self.grouped_layout:
            return self
        f, nb = self.format, self.cols // BLOCK
        codes = self.codes()  # [r, nb, 32]
        parts = []
        for b0 in range(0, nb, GROUP):
            group = codes[:, b0 : b0 + GROUP]  # [r, lanes, 32]
            group = group.reshape(self.rows, group.shape[1], 8, 4).transpose(1, 2)  # [r, t, i, k]
            if f.code_bytes == 16:  # vector 2s in the low nibbles, 2s + 1 in the high ones
                group = group[:, 0::2] | (group[:, 1::2] << 4)
            parts.append(group.reshape(self.rows, -1))
        data = self.data.clone()
        data[:, : nb * f.code_bytes] = torch.cat(parts, dim=1)
        return QuantizedWeight(f, data, self.rows, self.cols, grouped_layout=True)

    def codes(self) -> torch.Tensor:
        """The codes [rows, nb, 32] (uint8: nibbles 0..15, or int8's bytes), either layout."""
        f, nb = self.format, self.cols // BLOCK
        raw = self.data[:, : nb * f.code_bytes]
        if not self.grouped_layout:
            blocks = raw.reshape(self.rows, nb, f.code_bytes)
            return torch.cat([blocks & 15, blocks >> 4], -1) if f.code_bytes == 16 else blocks
        parts = []
        for b0 in range(0, nb, GROUP):
            lanes = min(GROUP, nb - b0)
            group = raw[:, b0 * f.code_bytes : (b0 + lanes) * f.code_bytes]
            group = group.reshape(self.rows, -1, lanes, 4)  # [r, vector, i, k]
            if f.code_bytes == 16:  # [r, s, i, k] -> [r, t = 2s + nibble, i, k]
                group = torch.stack([group & 15, group >> 4], dim=2).flatten(1, 2)
            parts.append(group.transpose(1, 2).reshape(self.rows, lanes, BLOCK))
        return torch.cat(parts, dim=1)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed with torch (reference of the kernels' expansion)."""
        f, nb = self.format, self.cols // BLOCK
        halves = self.data[:, nb * f.code_bytes :].contiguous().view(torch.float16)
        d = halves[:, :nb].float().unsqueeze(-1)
        q = self.codes()
        if f.code_bytes == 32:  # int8 codes
            return (q.view(torch.int8).float() * d).reshape(self.rows, self.cols)
        offset = halves[:, nb:].float().unsqueeze(-1) if f.scale_fields == 2 else -8.0 * d
        return (q.float() * d + offset).reshape(self.rows, self.cols)

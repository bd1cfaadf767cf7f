"""Weights kept in a GGUF block quantization, packed for the CPU kernels.

A GGUF tensor of a block format stores each run of 32 weights as one block (scales and
codes interleaved). ``QuantizedWeight`` keeps the same bytes, regrouped per row so that
a row's codes are contiguous and its scales follow them (the layout is spelled out at
the top of kernels/csrc/cpu/quant_linear.cpp); nothing is requantized, so every weight
dequantizes to exactly the fp32 value of ``gguf.quants.dequantize``.

The int8 kernel reads a second arrangement of the same bytes, ``tiled()``: rows in tiles
of 16, each block's codes interleaved 4 at a time across the tile's rows (spelled out in
quant_linear_int8.cpp), so one integer dot product per 64 bytes advances 16 rows' sums in
their own lanes; a tile's scales follow its codes.

``dequantize`` here is the torch reference of both layouts (the kernels' test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every supported format
TILE = 16  # rows per tile of the tiled layout


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
    tiled_layout: bool = False  # rows in tiles of 16 (the int8 kernel's layout)

    def __post_init__(self) -> None:
        if self.cols % BLOCK:
            raise ValueError(f"cols must be a multiple of {BLOCK}, got {self.cols}")
        rows = -(-self.rows // TILE) * TILE if self.tiled_layout else self.rows
        expected = (rows, self.cols // BLOCK * self.format.block_bytes)
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
        if self.tiled_layout:
            raise ValueError("take_rows: the tiled layout moves rows in tiles; take them first")
        data = self.data[index].contiguous()
        return QuantizedWeight(self.format, data, len(index), self.cols)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format and width, stacked (fusing); per-row
        layout only (tile the result)."""
        first = parts[0]
        key = (first.format, first.cols, False)
        if any((p.format, p.cols, p.tiled_layout) != key for p in parts):
            raise ValueError("only per-row weights of one format and width can be stacked")
        data = torch.cat([p.data for p in parts])
        return QuantizedWeight(first.format, data, data.shape[0], first.cols)

    def tiled(self) -> QuantizedWeight:
        """The same weight in the int8 kernel's layout: rows in tiles of 16 (the last one
        zero-padded), each tile's codes block by block with 4 codes of each row per 4-byte
        lane, then its scales block by block (spelled out in quant_linear_int8.cpp)."""
        if self.tiled_layout:
            return self
        f, nb, rows = self.format, self.cols // BLOCK, self.rows
        padded = -(-rows // TILE) * TILE
        codes = torch.zeros(padded, nb, BLOCK, dtype=torch.uint8)
        codes[:rows] = self.codes()
        codes = codes.reshape(-1, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, b, t, i, k]
        if f.code_bytes == 16:  # vector s: codes 8s.. in the low nibbles, 8s + 4.. in the high
            codes = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)
        halves = torch.zeros(padded, nb * f.scale_fields * 2, dtype=torch.uint8)
        halves[:rows] = self.data[:, nb * f.code_bytes :]
        # [tile, i, field, b, 2 bytes] -> [tile, field, b, i, 2 bytes]
        halves = halves.reshape(-1, TILE, f.scale_fields, nb, 2).permute(0, 2, 3, 1, 4)
        tiles = torch.cat(
            [
                codes.reshape(-1, TILE * nb * f.code_bytes),
                halves.reshape(-1, TILE * nb * 2 * f.scale_fields),
            ],
            dim=1,
        )
        data = tiles.reshape(padded, -1).contiguous()
        return QuantizedWeight(f, data, rows, self.cols, tiled_layout=True)

    def codes(self) -> torch.Tensor:
        """The codes [rows, nb, 32] (uint8: nibbles 0..15, or int8's bytes), either layout."""
        f, nb = self.format, self.cols // BLOCK
        if not self.tiled_layout:
            blocks = self.data[:, : nb * f.code_bytes].reshape(self.rows, nb, f.code_bytes)
            return torch.cat([blocks & 15, blocks >> 4], -1) if f.code_bytes == 16 else blocks
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, : TILE * nb * f.code_bytes]
        vectors = 4 if f.code_bytes == 16 else 8
        v = tiles.reshape(-1, nb, vectors, TILE, 4)  # [tile, b, vector, i, k]
        if f.code_bytes == 16:  # [tile, b, s, i, k] -> [tile, b, t = 2s + nibble, i, k]
            v = torch.stack([v & 15, v >> 4], dim=3).flatten(2, 3)
        return v.permute(0, 3, 1, 2, 4).reshape(-1, nb, BLOCK)[: self.rows]

    def scales(self) -> torch.Tensor:
        """The fp16 scales [rows, fields, nb] (d, then m for Q4_1), either layout."""
        f, nb = self.format, self.cols // BLOCK
        if not self.tiled_layout:
            raw = self.data[:, nb * f.code_bytes :].contiguous()
            return raw.view(torch.float16).reshape(self.rows, f.scale_fields, nb)
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, TILE * nb * f.code_bytes :]
        h = tiles.contiguous().view(torch.float16).reshape(-1, f.scale_fields, nb, TILE)
        return h.permute(0, 3, 1, 2).reshape(-1, f.scale_fields, nb)[: self.rows]

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed with torch (reference of the kernels' expansion)."""
        f = self.format
        halves = self.scales()
        d = halves[:, 0].float().unsqueeze(-1)
        q = self.codes()
        if f.code_bytes == 32:  # int8 codes
            return (q.view(torch.int8).float() * d).reshape(self.rows, self.cols)
        offset = halves[:, 1].float().unsqueeze(-1) if f.scale_fields == 2 else -8.0 * d
        return (q.float() * d + offset).reshape(self.rows, self.cols)

"""Weights kept in a GGUF block quantization, packed for the CPU kernels.

A GGUF tensor of a block format stores each run of 32 weights as one block (scales and
codes interleaved). ``QuantizedWeight`` keeps the same bytes, regrouped per row so that
a row's codes are contiguous and its scales follow them (the layout is spelled out at
the top of kernels/csrc/cpu/quant_linear.cpp); nothing is requantized, so every weight
dequantizes to exactly the fp32 value of ``gguf.quants.dequantize``. Q5_0, Q5_1 and the
K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256) and IQ4_NL / IQ4_XS (4-bit indices into
a fixed table of 16 values; IQ4_XS in super-blocks of 256) keep the file's bytes unchanged
(``file_order``): the exact kernel reads their blocks in place, and each has a tiled layout
for the int8 kernel too (``int8_layout``).

The int8 kernel reads a second arrangement of the same bytes, ``tiled()``: rows in tiles
of 16, each block's codes interleaved 4 at a time across the tile's rows (spelled out in
quant_linear_int8.cpp), so one integer dot product per 64 bytes advances 16 rows' sums in
their own lanes; a tile's scales follow its codes (Q5_0's 5th bits and Q6_K's top 2 bits
follow each block's nibbles, as planes of their own; Q4_K's packed 6-bit scales and mins
are regrouped per tile, 12 bytes per super-block and row as in the file; IQ4_NL is Q4_0's
layout with table indices for codes, IQ4_XS the same indices with its packed 6-bit scales
and d per super-block, 136 bytes per 256 weights and row as in the file).

``dequantize`` here is the torch reference of both layouts (the kernels' test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

BLOCK = 32  # weights per block, in every supported format
TILE = 16  # rows per tile of the tiled layout


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format, as the kernels read it: the one Python record of it (the C++
    one is kernels/csrc/cpu/common.h kFormats; tests/kernels/test_cpu_formats.py checks
    that the two agree). Every format is read by the exact kernel (quant_linear.cpp) and
    by ``dequantize`` (torch); ``int8``: by the int8 kernel too (quant_linear_int8.cpp)."""

    name: str
    code: int  # the kernels' format number (common.h Format)
    ggml_type: GGMLQuantizationType | None  # the GGUF tensor type; None: STACKED
    # The exact kernel's layout: per row, the blocks' codes (code_bytes per block: 16 of
    # nibbles, 32 of int8), then scale_fields fp16 values per block (d, or d and m); or
    # (``file_order``) the file's blocks as they are, read in place (the layouts at the top
    # of quant_linear.cpp).
    code_bytes: int = 0
    scale_fields: int = 0
    file_order: bool = False
    # The int8 kernel's tiled layout (quant_linear_int8.cpp): code bytes per block of 32
    # and row, then fp16 fields per block of 32 (the K-quants and IQ4_XS: 0, their scales
    # per super-block); None: the int8 kernel does not read the format.
    int8_layout: tuple[int, int] | None = None

    @property
    def block_values(self) -> int:
        """Weights per block (256: a K-quant's or IQ4_XS's super-block), as ggml has it."""
        return GGML_QUANT_SIZES[self.ggml_type][0] if self.ggml_type is not None else BLOCK

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the GGUF file (and per row in either layout), as ggml has it."""
        return GGML_QUANT_SIZES[self.ggml_type][1] if self.ggml_type is not None else 0

    @property
    def int8(self) -> bool:
        """Whether the int8 kernel reads the format (in its tiled layout, ``tiled()``)."""
        return self.int8_layout is not None


# The int8 layouts: Q4_0, Q4_1, Q8_0 the exact kernel's codes and fields, tiled; Q5_0 the
# nibbles as Q4_0's, then a plane of 5th bits; Q5_1 Q5_0's codes, fp16 d and m; Q6_K the
# nibbles, then 2 vectors of top 2 bits, int8 sub-block scales, fp16 d; Q4_K the nibbles
# as Q4_0's, the 6-bit scales and mins repacked per tile, fp16 d and dmin; Q5_K the same
# with Q5_0's plane of 5th bits; IQ4_NL Q4_0's layout (the nibbles are table indices);
# IQ4_XS the same nibbles, then per super-block its packed 6-bit scales and fp16 d.
_T = GGMLQuantizationType
FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 0, _T.Q4_0, code_bytes=16, scale_fields=1, int8_layout=(16, 1)),
        BlockFormat("q4_1", 1, _T.Q4_1, code_bytes=16, scale_fields=2, int8_layout=(16, 2)),
        BlockFormat("q8_0", 2, _T.Q8_0, code_bytes=32, scale_fields=1, int8_layout=(32, 1)),
        BlockFormat("q5_0", 3, _T.Q5_0, file_order=True, int8_layout=(20, 1)),
        BlockFormat("q5_1", 4, _T.Q5_1, file_order=True, int8_layout=(20, 2)),
        BlockFormat("q4_k", 5, _T.Q4_K, file_order=True, int8_layout=(16, 0)),
        BlockFormat("q5_k", 6, _T.Q5_K, file_order=True, int8_layout=(20, 0)),
        BlockFormat("q6_k", 7, _T.Q6_K, file_order=True, int8_layout=(24, 0)),
        BlockFormat("iq4_nl", 9, _T.IQ4_NL, file_order=True, int8_layout=(16, 1)),
        BlockFormat("iq4_xs", 10, _T.IQ4_XS, file_order=True, int8_layout=(16, 0)),
    )
}
# Weights of different formats stacked row-wise (QuantizedWeight.stack): data is a table of
# the parts, each computed in its own format (quant_linear.cpp hr_quant_linear).
STACKED = BlockFormat("stacked", 8, None, file_order=True)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight in a block format; ``data`` is uint8 [rows, row_bytes]."""

    format: BlockFormat
    data: torch.Tensor
    rows: int
    cols: int
    tiled_layout: bool = False  # rows in tiles of 16 (the int8 kernel's layout)
    parts: tuple[QuantizedWeight, ...] = ()  # STACKED: the weights, top to bottom

    def __post_init__(self) -> None:
        if self.format is STACKED:
            return
        values = self.format.block_values
        if self.cols % values:
            name = self.format.name
            raise ValueError(f"cols must be a multiple of {values} ({name}), got {self.cols}")
        rows = -(-self.rows // TILE) * TILE if self.tiled_layout else self.rows
        expected = (rows, self.cols // values * self.format.block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"data must be uint8 {expected}, got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) if self.parts else self.data.numel()

    @staticmethod
    def stack(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one width in different formats (the fused q|k|v of a
        Q4_K_M file, where v is Q6_K or Q8_0 on some layers): the kernel computes each part
        in its own format into its columns of the output; all per-row (the exact kernel)
        or all tiled (the int8 kernel). The parts' tensors are
        held here, their addresses in ``data`` (int64: count, then format, address, rows)."""
        first = parts[0]
        tiled = first.tiled_layout  # all per-row (the exact kernel) or all tiled (int8)
        if any(p.cols != first.cols or p.tiled_layout != tiled or p.parts for p in parts):
            raise ValueError("only weights of one width and one layout can be stacked")
        table = [len(parts)]
        for p in parts:
            table += [p.format.code, p.data.data_ptr(), p.rows]
        data = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
        rows = sum(p.rows for p in parts)
        return QuantizedWeight(STACKED, data, rows, first.cols, tiled, tuple(parts))

    @classmethod
    def from_gguf(cls, fmt: str, blocks: torch.Tensor, cols: int) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes (uint8, rows * cols / 32 blocks, row-major)."""
        f = FORMATS[fmt]
        if cols % f.block_values:
            raise ValueError(f"cols must be a multiple of {f.block_values} ({fmt}), got {cols}")
        if f.file_order:
            data = blocks.reshape(-1, cols // f.block_values * f.block_bytes).contiguous()
            return cls(f, data, data.shape[0], cols)
        nb = cols // BLOCK
        b = blocks.reshape(-1, nb, f.block_bytes)
        rows = b.shape[0]
        scales = 2 * f.scale_fields
        parts = [b[:, :, scales:].reshape(rows, -1)]  # codes
        parts += [b[:, :, 2 * i : 2 * i + 2].reshape(rows, -1) for i in range(f.scale_fields)]
        return cls(f, torch.cat(parts, dim=1).contiguous(), rows, cols)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (a permutation or selection), in that order."""
        if self.tiled_layout or self.parts:
            raise ValueError("take_rows: the tiled layout moves rows in tiles; take them first")
        data = self.data[index].contiguous()
        return QuantizedWeight(self.format, data, len(index), self.cols)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format and width, stacked (fusing); per-row
        layout only (tile the result)."""
        first = parts[0]
        if any(p.parts for p in parts):
            raise ValueError("stacked weights cannot be concatenated")
        key = (first.format, first.cols, False)
        if any((p.format, p.cols, p.tiled_layout) != key for p in parts):
            raise ValueError("only per-row weights of one format and width can be stacked")
        data = torch.cat([p.data for p in parts])
        return QuantizedWeight(first.format, data, data.shape[0], first.cols)

    def for_int8(self) -> QuantizedWeight:
        """This weight in a format the int8 kernel has: every block format stays as it is
        (the kernel reads its codes in its tiled layout, as many bytes as the file's: Q5_0
        and Q5_1 22 and 24 per 32 weights, IQ4_NL 18, Q4_K, Q5_K, Q6_K and IQ4_XS 144, 176,
        210 and 136 per 256); a stack of per-row parts is refused (convert the parts, then
        stack them)."""
        f = self.format
        if f.int8 or self.tiled_layout:
            return self
        if self.parts:
            raise ValueError("for_int8: convert the parts, then stack or fuse them")
        raise ValueError(f"{f.name}: no int8 kernel for this format yet")

    def as_q4_1(self) -> QuantizedWeight:
        """A Q4_K weight as Q4_1 (what int8 mode did with Q4_K before the int8 kernel read it;
        bench/kquant_pass.py times it): the same nibbles, each block's d * sc and -dmin * m
        rounded to fp16 (a relative change below 2^-11 of the block's scale), 5 bits per
        weight."""
        if self.format.name != "q4_k" or self.tiled_layout:
            raise ValueError(f"as_q4_1: a per-row Q4_K weight, got {self.format.name}")
        return _q4_k_as_q4_1(self.data, self.rows, self.cols)

    def as_q8_0(self) -> QuantizedWeight:
        """This weight as Q8_0 (what int8 mode did with Q5_0 and Q6_K before the int8
        kernel read them; bench/kquant_pass.py times it): Q5_0 exactly
        (codes q - 16, the same d), other formats requantized (as for_int8 does: at most
        d / 2 per weight); a Q8_0 weight as it is."""
        f, rows = self.format, self.rows
        if f.name == "q8_0":
            return self
        if f.name == "q5_0" and not self.tiled_layout:
            d = self.data.reshape(rows, -1, 22)[..., :2].contiguous().view(torch.float16)
            return _q8_0(rows, self.cols, d, _q5_codes(self.data, rows, 2) - 16)
        return _requantize_q8_0(self.dequantize())

    def tiled(self) -> QuantizedWeight:
        """The same weight in the int8 kernel's layout: rows in tiles of 16 (the last one
        zero-padded), each tile's codes block by block with 4 codes of each row per 4-byte
        lane (Q5_0: their low nibbles, then the plane of 5th bits), then its scales block
        by block (spelled out in quant_linear_int8.cpp). A stack of per-row parts becomes the
        stack of its parts tiled, each in its own format."""
        if self.tiled_layout:
            return self
        if self.parts:  # a stack of per-row parts: each part tiled in its own format
            return QuantizedWeight.stack([p.tiled() for p in self.parts])
        if not self.format.int8:
            raise ValueError(
                f"{self.format.name}: no int8 kernel for this format yet"
                " (run these weights with --weights quantized)"
            )
        return _TILERS.get(self.format.name, _tiled_blocks)(self)

    def codes(self) -> torch.Tensor:
        """The codes [rows, nb, 32] (uint8: nibbles 0..15 (IQ4: table indices), Q5_x's
        0..31, or int8's bytes), either layout."""
        f, nb = self._regrouped(), self.cols // BLOCK
        code_bytes, fields = f.int8_layout
        if not self.tiled_layout:
            if f.name in ("q5_0", "q5_1"):
                return _q5_codes(self.data, self.rows, 2 * fields).to(torch.uint8)
            if f.name == "q6_k":
                return _q6k_fields(self.data, self.rows)[0].reshape(self.rows, nb, BLOCK)
            if f.name in ("q4_k", "q5_k"):
                return _qk_fields(self.data, self.rows, f.name == "q5_k")[0]
            if f.name in ("iq4_nl", "iq4_xs"):
                return _iq4_fields(self.data, self.rows, f.name == "iq4_xs")[0]
            blocks = self.data[:, : nb * f.code_bytes].reshape(self.rows, nb, f.code_bytes)
            return torch.cat([blocks & 15, blocks >> 4], -1) if f.code_bytes == 16 else blocks
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, : TILE * nb * code_bytes]
        blocks = tiles.reshape(-1, nb, TILE * code_bytes)
        vectors = 8 if code_bytes == 32 else 4
        v = blocks[:, :, : TILE * 4 * vectors].reshape(-1, nb, vectors, TILE, 4)
        if code_bytes != 32:  # [tile, b, s, i, k] -> [tile, b, t = 2s + nibble, i, k]
            v = torch.stack([v & 15, v >> 4], dim=3).flatten(2, 3)
        if code_bytes == 24:  # Q6_K: bits 2j.. of top-bit vector h are bits 4, 5 of 4h + j
            top = blocks[:, :, TILE * 16 :].reshape(-1, nb, 2, 1, TILE, 4)
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1, 1)
            v = v | (((top >> shifts) & 3).reshape(-1, nb, 8, TILE, 4) << 4)
        if code_bytes == 20:  # Q5_0: bit 4i + k of word t of the plane is bit 4 of v[t, i, k]
            plane = blocks[:, :, TILE * 16 :].reshape(-1, nb, 8, 8, 1)
            bits = (plane >> torch.arange(8, dtype=torch.uint8)) & 1  # [tile, b, t, byte, bit]
            v = v | (bits.reshape(-1, nb, 8, TILE, 4) << 4)
        return v.permute(0, 3, 1, 2, 4).reshape(-1, nb, BLOCK)[: self.rows]

    def scales(self) -> torch.Tensor:
        """The fp16 scales [rows, fields, nb] (d, then m for Q4_1 and Q5_1), either layout
        (K-quants: ``q4_k_scales``, ``q6_k_scales``)."""
        f, nb = self._regrouped(), self.cols // BLOCK
        if f.name in ("q4_k", "q5_k", "q6_k", "iq4_xs"):
            see = {"q6_k": "q6_k_scales", "iq4_xs": "iq4_xs_scales"}.get(f.name, "q4_k_scales")
            raise ValueError(f"{f.name}: scales per super-block of 256, see {see}")
        code_bytes, fields = f.int8_layout
        if not self.tiled_layout:
            if f.name == "iq4_nl":
                return _iq4_fields(self.data, self.rows, False)[1].reshape(self.rows, 1, nb)
            if f.name in ("q5_0", "q5_1"):  # d (and m) before each block's codes
                raw = self.data.reshape(self.rows, nb, 20 + 2 * fields)[..., : 2 * fields]
                h = raw.contiguous().view(torch.float16).reshape(self.rows, nb, fields)
                return h.permute(0, 2, 1).reshape(-1).view(self.rows, fields, nb)
            raw = self.data[:, nb * f.code_bytes :].contiguous()
            return raw.view(torch.float16).reshape(self.rows, f.scale_fields, nb)
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, TILE * nb * code_bytes :]
        h = tiles.contiguous().view(torch.float16).reshape(-1, fields, nb, TILE)
        return h.permute(0, 3, 1, 2).reshape(-1, fields, nb)[: self.rows]

    def q6_k_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q6_K weight's int8 sub-block scales [rows, nsb, 16] and fp16 d [rows, nsb],
        either layout."""
        nsb = self.cols // 256
        if not self.tiled_layout:
            _, sc, d = _q6k_fields(self.data, self.rows)
            return sc, d
        width = TILE * self.data.shape[1]
        tiles = self.data.reshape(-1, width)[:, TILE * nsb * 8 * 24 :]
        sc = tiles[:, : TILE * nsb * 16].contiguous().view(torch.int8)
        sc = sc.reshape(-1, nsb * 16, TILE).permute(0, 2, 1).reshape(-1, nsb, 16)
        d = tiles[:, TILE * nsb * 16 :].contiguous().view(torch.float16)
        d = d.reshape(-1, nsb, TILE).permute(0, 2, 1).reshape(-1, nsb)
        return sc[: self.rows], d[: self.rows]

    def q4_k_scales(self) -> tuple[torch.Tensor, ...]:
        """A Q4_K (or Q5_K) weight's 6-bit scales and mins [rows, nb] (uint8, one per block
        of 32) and fp16 d and dmin [rows, nsb], either layout."""
        high_bits = self.format.name == "q5_k"
        if not self.tiled_layout:
            return _qk_fields(self.data, self.rows, high_bits)[1:]
        nb, nsb = self.cols // BLOCK, self.cols // 256
        code_bytes = 20 if high_bits else 16
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, TILE * nb * code_bytes :]
        packed = tiles[:, : nsb * 192].reshape(-1, nsb, 12, TILE).int()
        low, top = packed[:, :, :8], packed[:, :, 8:].repeat(1, 1, 2, 1)  # block j: c = j % 4
        shift = (4 * (torch.arange(8) // 4)).reshape(1, 1, 8, 1)
        sc = (low & 15) | ((top >> shift) & 3) << 4
        mn = (low >> 4) | ((top >> (shift + 2)) & 3) << 4
        halves = tiles[:, nsb * 192 :].contiguous().view(torch.float16).reshape(-1, nsb, 2, TILE)
        out = [v.permute(0, 3, 1, 2).reshape(-1, nb).to(torch.uint8) for v in (sc, mn)]
        out += [halves[:, :, f].permute(0, 2, 1).reshape(-1, nsb) for f in (0, 1)]
        return tuple(v[: self.rows] for v in out)

    def iq4_xs_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An IQ4_XS weight's 6-bit block scales ls [rows, nb] (uint8; the block's scale is
        d * (ls - 32)) and fp16 d [rows, nsb], either layout."""
        if not self.tiled_layout:
            return _iq4_fields(self.data, self.rows, True)[1:]
        nb, nsb = self.cols // BLOCK, self.cols // 256
        tiles = self.data.reshape(-1, TILE * self.data.shape[1])[:, TILE * nb * 16 :]
        per_sb = tiles.reshape(-1, nsb, 128)
        low = per_sb[:, :, :64].reshape(-1, nsb, 4, 1, TILE).int()  # blocks 2c, 2c + 1
        low = torch.cat([low & 15, low >> 4], dim=3).reshape(-1, nsb, 8, TILE)
        high = per_sb[:, :, 64:96].reshape(-1, nsb, 2, 1, TILE).int()  # blocks 4h..4h + 3
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(4, 1)
        high = ((high >> shifts) & 3).reshape(-1, nsb, 8, TILE)
        ls = (low | high << 4).to(torch.uint8).permute(0, 3, 1, 2).reshape(-1, nb)
        d = per_sb[:, :, 96:].contiguous().view(torch.float16).reshape(-1, nsb, TILE)
        d = d.permute(0, 2, 1).reshape(-1, nsb)
        return ls[: self.rows], d[: self.rows]

    def _regrouped(self) -> BlockFormat:
        if not self.format.int8:
            raise ValueError(f"{self.format.name}: codes and scales are read in file order")
        return self.format

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], computed with torch (reference of the kernels' expansion)."""
        f = self.format
        if self.parts:
            return torch.cat([p.dequantize() for p in self.parts])
        if f.file_order and not self.tiled_layout:
            return _DEQUANTIZE_FILE_ORDER[f.name](self.data, self.rows).reshape(self.rows, -1)
        if f.name == "q6_k":  # as gguf: (d * sc) * (q - 32), per half-block of 16
            sc, d = self.q6_k_scales()
            scale = (d.float().unsqueeze(-1) * sc.float()).reshape(self.rows, -1, 1)
            q = (self.codes().int() - 32).float().reshape(self.rows, -1, 16)
            return (scale * q).reshape(self.rows, self.cols)
        if f.name == "iq4_xs":  # as gguf: (d * (ls - 32)) * value, per block of 32
            ls, d = self.iq4_xs_scales()
            dl = d.float().repeat_interleave(8, 1) * (ls.int() - 32).float()
            values = _IQ4_TABLE[self.codes().long()]
            return (dl.unsqueeze(-1) * values).reshape(self.rows, self.cols)
        if f.name in ("q4_k", "q5_k"):  # as gguf: (d * sc) * q - dmin * m, per block of 32
            sc, mn, d, dmin = self.q4_k_scales()
            scale = (d.float().repeat_interleave(8, 1) * sc.float()).unsqueeze(-1)
            offset = (dmin.float().repeat_interleave(8, 1) * mn.float()).unsqueeze(-1)
            return (scale * self.codes().float() - offset).reshape(self.rows, self.cols)
        halves = self.scales()
        d = halves[:, 0].float().unsqueeze(-1)
        q = self.codes()
        if f.code_bytes == 32:  # int8 codes
            return (q.view(torch.int8).float() * d).reshape(self.rows, self.cols)
        if f.name == "iq4_nl":  # as gguf: d * value
            return (d * _IQ4_TABLE[q.long()]).reshape(self.rows, self.cols)
        if f.name == "q5_0":  # as gguf: d * (q - 16)
            return (d * (q.int() - 16).float()).reshape(self.rows, self.cols)
        with_min = f.int8_layout[1] == 2  # Q4_1, Q5_1: as gguf, d * q + m
        offset = halves[:, 1].float().unsqueeze(-1) if with_min else -8.0 * d
        return (q.float() * d + offset).reshape(self.rows, self.cols)


# The formats kept in file order, dequantized with torch as gguf.quants does with numpy
# (the same fp32 operations in the same order, so the same bits).


def _halves(b: torch.Tensor) -> torch.Tensor:
    """fp16 bytes [..., 2] -> fp32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _q5_codes(data: torch.Tensor, rows: int, h: int) -> torch.Tensor:
    """The 5-bit codes [rows, nb, 32] of Q5_0 (h = 2 header bytes) or Q5_1 (h = 4)."""
    b = data.reshape(rows, -1, h + 20).int()
    qh = b[..., h] | b[..., h + 1] << 8 | b[..., h + 2] << 16 | b[..., h + 3] << 24
    high = (qh.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    qs = b[..., h + 4 :]
    return torch.cat([qs & 15, qs >> 4], dim=-1) | high << 4


def _q5(data: torch.Tensor, rows: int, with_min: bool) -> torch.Tensor:
    h = 4 if with_min else 2
    raw = data.reshape(rows, -1, h + 20)
    d, q = _halves(raw[..., :2]), _q5_codes(data, rows, h)
    if with_min:
        return d * q.float() + _halves(raw[..., 2:4])
    return d * (q - 16).float()


def _scale_min_k(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] (gguf's get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _qk(data: torch.Tensor, rows: int, high_bits: bool) -> torch.Tensor:
    codes, sc, mn, d, dmin = _qk_fields(data, rows, high_bits)
    d, dmin = d.float().repeat_interleave(8, dim=1), dmin.float().repeat_interleave(8, dim=1)
    scale = (d * sc.float()).unsqueeze(-1)  # per block of 32: d * sc, exact in fp32
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * codes.float() - offset).reshape(rows, -1, 8, 32)


def _q6k(data: torch.Tensor, rows: int) -> torch.Tensor:
    codes, sc, d = _q6k_fields(data, rows)
    q = (codes.int() - 32).float().reshape(rows, -1, 16, 16)
    scale = (d.float().unsqueeze(-1) * sc.float()).unsqueeze(-1)
    return scale * q


# llama.cpp's kvalues_iq4nl: the 16 values a 4-bit IQ4_NL / IQ4_XS index stands for.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_TABLE = torch.tensor(IQ4_VALUES, dtype=torch.float32)


def _iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """Index bytes [..., 16] -> table values [..., 32] (low nibbles 0-15, high 16-31)."""
    return _IQ4_TABLE[torch.cat([qs & 15, qs >> 4], dim=-1).long()]


def _iq4_fields(data: torch.Tensor, rows: int, xs: bool) -> tuple[torch.Tensor, ...]:
    """IQ4_NL's (xs: IQ4_XS's) table indices [rows, nb, 32] (uint8 0..15, in value order)
    and fp16 d [rows, nb] (IQ4_XS: 6-bit block scales ls [rows, nb] (uint8), fp16 d
    [rows, nsb]): what _iq4nl / _iq4xs dequantize and the int8 tiles hold."""
    raw = data.reshape(rows, -1, 136 if xs else 18)
    qs = raw[..., 8:].reshape(rows, -1, 16) if xs else raw[..., 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, -1, BLOCK)
    d = raw[..., :2].contiguous().view(torch.float16).reshape(rows, -1)
    if not xs:
        return codes, d
    b = raw.int()
    high = (b[..., 2] | b[..., 3] << 8).unsqueeze(-1)  # scales_h: 2 bits per block
    j = torch.arange(8, dtype=torch.int32)
    low = (b[..., 4 + j // 2] >> (4 * (j % 2))) & 15  # scales_l: a nibble per block
    ls = (low | ((high >> (2 * j)) & 3) << 4).to(torch.uint8).reshape(rows, -1)
    return codes, ls, d


def _iq4nl(data: torch.Tensor, rows: int) -> torch.Tensor:
    raw = data.reshape(rows, -1, 18)
    return _halves(raw[..., :2]) * _iq4_values(raw[..., 2:].int())


def _iq4xs(data: torch.Tensor, rows: int) -> torch.Tensor:
    raw = data.reshape(rows, -1, 136)
    b = raw.int()
    high = (b[..., 2] | b[..., 3] << 8).unsqueeze(-1)  # [rows, nsb, 1]
    j = torch.arange(8, dtype=torch.int32)
    low = (b[..., 4 + j // 2] >> (4 * (j % 2))) & 15
    ls = low | ((high >> (2 * j)) & 3) << 4  # [rows, nsb, 8]
    dl = (_halves(raw[..., :2]) * (ls - 32).float()).unsqueeze(-1)
    return dl * _iq4_values(b[..., 8:].reshape(rows, -1, 8, 16))


def _q6k_fields(data: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """Q6_K's codes [rows, nsb, 256] (uint8 0..63, in value order), int8 sub-block scales
    [rows, nsb, 16] and fp16 d [rows, nsb] (what _q6k dequantizes and the int8 tiles hold)."""
    raw = data.reshape(rows, -1, 210)
    b = raw.int()
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, -1, 8, 32)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(4, 1)) & 3).reshape(
        rows, -1, 8, 32
    )
    codes = (low | high << 4).to(torch.uint8).reshape(rows, -1, 256)
    sc = raw[..., 192:208].contiguous().view(torch.int8)
    d = raw[..., 208:210].contiguous().view(torch.float16).reshape(rows, -1)
    return codes, sc, d


def _qk_fields(data: torch.Tensor, rows: int, high_bits: bool) -> tuple[torch.Tensor, ...]:
    """Q4_K's (Q5_K's) codes [rows, nb, 32] (uint8 0..15 (0..31), in value order), 6-bit
    scales and mins [rows, nb] (uint8) and fp16 d and dmin [rows, nsb] (what _qk
    dequantizes and the int8 tiles hold)."""
    size = 176 if high_bits else 144
    raw = data.reshape(rows, -1, size)
    sc, mn = _scale_min_k(raw[..., 4:16])
    qs = raw[..., size - 128 :].reshape(rows, -1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, -1, 8, 32)
    if high_bits:
        qh = raw[..., 16:48].reshape(rows, -1, 1, 32)
        codes = codes | ((qh >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1) << 4
    codes = codes.reshape(rows, -1, 32)
    halves = raw[..., :4].contiguous().view(torch.float16)  # [rows, nsb, 2]: d, dmin
    return codes, sc.reshape(rows, -1), mn.reshape(rows, -1), halves[..., 0], halves[..., 1]


def _tiled_blocks(w: QuantizedWeight) -> QuantizedWeight:
    """The formats with one scale (and min) per block of 32 (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
    IQ4_NL) in the int8 kernel's tiled layout: per tile, block by block the codes (Q8_0's
    8 vectors of bytes, else 4 of nibbles, then Q5's plane of 5th bits), then the fp16
    fields block by block."""
    f, nb, rows = w.format, w.cols // BLOCK, w.rows
    code_bytes, fields = f.int8_layout
    padded = -(-rows // TILE) * TILE
    codes = torch.zeros(padded, nb, BLOCK, dtype=torch.uint8)
    codes[:rows] = w.codes()
    codes = codes.reshape(-1, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, b, t, i, k]
    if code_bytes == 32:
        blocks = codes.reshape(-1, nb, TILE * 32)
    else:  # vector s: codes 8s.. in the low nibbles, 8s + 4.. in the high
        low = codes & 15
        blocks = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(-1, nb, TILE * 16)
    if code_bytes == 20:  # Q5_0: word t's bit 4i + k = bit 4 of code 4t + k of row i
        bits = (codes >> 4).reshape(-1, nb, 8, 8, 8)  # [tile, b, t, byte, bit]
        plane = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        blocks = torch.cat([blocks, plane.reshape(-1, nb, 64)], dim=-1)
    halves = torch.zeros(padded, fields, nb, 2, dtype=torch.uint8)
    halves[:rows] = w.scales().contiguous().view(torch.uint8).reshape(rows, fields, nb, 2)
    # [tile, i, field, b, 2 bytes] -> [tile, field, b, i, 2 bytes]
    halves = halves.reshape(-1, TILE, fields, nb, 2).permute(0, 2, 3, 1, 4)
    tiles = torch.cat(
        [blocks.reshape(-1, TILE * nb * code_bytes), halves.reshape(-1, TILE * nb * 2 * fields)],
        dim=1,
    )
    data = tiles.reshape(padded, -1).contiguous()
    return QuantizedWeight(f, data, rows, w.cols, tiled_layout=True)


def _tiled_qk(w: QuantizedWeight) -> QuantizedWeight:
    """Q4_K (Q5_K) in the int8 kernel's tiled layout (quant_linear_int8.cpp): per tile,
    block by block of 32 the nibbles as Q4_0's 4 vectors (Q5_K: then Q5_0's plane of 5th
    bits); then per super-block the 8 blocks' scales and mins, [8][16] bytes of their low 4
    bits (sc | m << 4) and [4][16] bytes of their top 2 bits (byte c: blocks c and c + 4);
    then per super-block [2][16]
    fp16 d and dmin. 144 (176) bytes per 256 weights and row, as in the file."""
    rows, nb, nsb = w.rows, w.cols // BLOCK, w.cols // 256
    high_bits = w.format.name == "q5_k"
    padded = -(-rows // TILE) * TILE
    codes = torch.zeros(padded, nb, BLOCK, dtype=torch.uint8)
    sc = torch.zeros(padded, nsb, 8, dtype=torch.uint8)
    mn = torch.zeros(padded, nsb, 8, dtype=torch.uint8)
    halves = torch.zeros(padded, nsb, 2, dtype=torch.float16)
    c, s, m, d, dmin = _qk_fields(w.data, rows, high_bits)
    codes[:rows], sc[:rows], mn[:rows] = c, s.reshape(rows, nsb, 8), m.reshape(rows, nsb, 8)
    halves[:rows, :, 0], halves[:rows, :, 1] = d, dmin
    codes = codes.reshape(-1, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, b, t, i, k]
    low4 = codes & 15
    nibbles = (low4[:, :, 0::2] | (low4[:, :, 1::2] << 4)).reshape(-1, nb, TILE * 16)
    if high_bits:  # Q5_0's plane: word t's bit 4i + k = bit 4 of code 4t + k of row i
        bits = (codes >> 4).reshape(-1, nb, 8, 8, 8)  # [tile, b, t, byte, bit]
        plane = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        nibbles = torch.cat([nibbles, plane.reshape(-1, nb, 64)], dim=-1)
    nibbles = nibbles.reshape(padded // TILE, -1)
    low = (sc & 15) | ((mn & 15) << 4)  # [padded, nsb, 8]
    top = (sc >> 4) | ((mn >> 4) << 2)  # 4 bits per block
    top = top[..., :4] | (top[..., 4:] << 4)  # [padded, nsb, 4]: blocks c and c + 4
    packed = torch.cat([low, top], dim=-1).reshape(-1, TILE, nsb, 12).permute(0, 2, 3, 1)
    halves = halves.view(torch.uint8).reshape(-1, TILE, nsb, 2, 2).permute(0, 2, 3, 1, 4)
    tiles = torch.cat([nibbles, packed.reshape(-1, nsb * 192), halves.reshape(-1, nsb * 64)], dim=1)
    data = tiles.reshape(padded, -1).contiguous()
    return QuantizedWeight(w.format, data, rows, w.cols, tiled_layout=True)


def _tiled_iq4_xs(w: QuantizedWeight) -> QuantizedWeight:
    """IQ4_XS in the int8 kernel's tiled layout (quant_linear_int8.cpp): per tile, block by
    block of 32 the table indices as Q4_0's 4 vectors; then per super-block of 256 [4][16]
    bytes of the file's scales_l (byte c * 16 + i: the 4-bit low parts of ls of blocks 2c
    and 2c + 1 of row i), [2][16] bytes of its scales_h (byte h * 16 + i: 2 bits of ls of
    each of blocks 4h..4h + 3) and [16] fp16 d. The file's 136 bytes per 256 and row."""
    rows, nb, nsb = w.rows, w.cols // BLOCK, w.cols // 256
    padded = -(-rows // TILE) * TILE
    codes = torch.zeros(padded, nb, BLOCK, dtype=torch.uint8)
    ls = torch.zeros(padded, nsb, 8, dtype=torch.uint8)
    d = torch.zeros(padded, nsb, dtype=torch.float16)
    c, s, d[:rows] = _iq4_fields(w.data, rows, True)
    codes[:rows], ls[:rows] = c, s.reshape(rows, nsb, 8)
    codes = codes.reshape(-1, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, b, t, i, k]
    nibbles = (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).reshape(-1, nb * TILE * 16)
    low = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)  # [padded, nsb, 4]
    top = (ls >> 4).reshape(padded, nsb, 2, 4)
    top = (top << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    tiles = padded // TILE
    low = low.reshape(tiles, TILE, nsb, 4).permute(0, 2, 3, 1).reshape(tiles, nsb, 64)
    top = top.reshape(tiles, TILE, nsb, 2).permute(0, 2, 3, 1).reshape(tiles, nsb, 32)
    halves = d.view(torch.uint8).reshape(tiles, TILE, nsb, 2).permute(0, 2, 1, 3)
    scales = torch.cat([low, top, halves.reshape(tiles, nsb, 32)], dim=-1)  # 128 a super-block
    data = torch.cat([nibbles, scales.reshape(tiles, -1)], dim=1).reshape(padded, -1)
    return QuantizedWeight(w.format, data.contiguous(), rows, w.cols, tiled_layout=True)


def _tiled_q6_k(w: QuantizedWeight) -> QuantizedWeight:
    """Q6_K in the int8 kernel's tiled layout (quant_linear_int8.cpp): per tile, block by
    block of 32 the nibbles as Q4_0's 4 vectors and 2 vectors of the top 2 bits, then the
    sub-block scales [nb][2][16] (int8) and the super-blocks' d [nsb][16] (fp16)."""
    rows, nb, nsb = w.rows, w.cols // BLOCK, w.cols // 256
    padded = -(-rows // TILE) * TILE
    codes = torch.zeros(padded, nb, BLOCK, dtype=torch.uint8)
    sc = torch.zeros(padded, nsb, 16, dtype=torch.int8)
    d = torch.zeros(padded, nsb, dtype=torch.float16)
    c, sc[:rows], d[:rows] = _q6k_fields(w.data, rows)
    codes[:rows] = c.reshape(rows, nb, BLOCK)
    codes = codes.reshape(-1, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, b, t, i, k]
    low = codes & 15
    nibbles = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(-1, nb, TILE * 16)
    top = (codes >> 4).reshape(-1, nb, 2, 4, TILE, 4)  # [tile, b, h, j, i, k]
    top = (top << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1, 1)).sum(
        3, dtype=torch.uint8
    )
    blocks = torch.cat([nibbles, top.reshape(-1, nb, TILE * 8)], dim=-1)
    scales = sc.view(torch.uint8).reshape(-1, TILE, nsb * 16).permute(0, 2, 1)
    halves = d.view(torch.uint8).reshape(-1, TILE, nsb, 2).permute(0, 2, 1, 3)
    tiles = torch.cat(
        [
            blocks.reshape(-1, TILE * nb * 24),
            scales.reshape(-1, TILE * nsb * 16),
            halves.reshape(-1, TILE * nsb * 2),
        ],
        dim=1,
    )
    data = tiles.reshape(padded, -1).contiguous()
    return QuantizedWeight(w.format, data, rows, w.cols, tiled_layout=True)


# The formats whose scales come per super-block of 256, each with a tiler of its own.
_TILERS = {"q4_k": _tiled_qk, "q5_k": _tiled_qk, "q6_k": _tiled_q6_k, "iq4_xs": _tiled_iq4_xs}


def _q8_0(rows: int, cols: int, d: torch.Tensor, codes: torch.Tensor) -> QuantizedWeight:
    """A Q8_0 weight from fp16 d [rows, nb, 1] and integer-valued codes [rows, nb, 32]."""
    blocks = torch.cat(
        [d.view(torch.uint8), codes.to(torch.int8).view(torch.uint8)], dim=-1
    ).reshape(rows, -1)
    return QuantizedWeight.from_gguf("q8_0", blocks, cols)


def _requantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """fp32 [rows, cols] to Q8_0: d = fp16(amax / 127) per block, codes round(w / d) with
    that d (ggml divides by the fp32 d: a code can then be off by d's fp16 rounding)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, -1, BLOCK)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).half()
    df = d.float()
    codes = torch.where(df > 0, blocks / df, torch.zeros_like(blocks))
    return _q8_0(rows, cols, d, codes.round().clamp(-127, 127))


def _q4_k_as_q4_1(data: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    raw = data.reshape(rows, -1, 144)
    b = raw.int()
    sc, mn = _scale_min_k(b[..., 4:16])
    d = (_halves(raw[..., 0:2]) * sc.float()).half().reshape(rows, -1, 1)
    m = (-(_halves(raw[..., 2:4]) * mn.float())).half().reshape(rows, -1, 1)
    qs = raw[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, -1, 32)  # [rows, nb, 32] codes
    packed = q[..., :16] | (q[..., 16:] << 4)  # Q4_1: low nibbles 0-15, high 16-31
    parts = [d.view(torch.uint8), m.view(torch.uint8), packed]
    return QuantizedWeight.from_gguf("q4_1", torch.cat(parts, dim=-1).reshape(rows, -1), cols)


_DEQUANTIZE_FILE_ORDER = {
    "q5_0": lambda data, rows: _q5(data, rows, with_min=False),
    "q5_1": lambda data, rows: _q5(data, rows, with_min=True),
    "q4_k": lambda data, rows: _qk(data, rows, high_bits=False),
    "q5_k": lambda data, rows: _qk(data, rows, high_bits=True),
    "q6_k": _q6k,
    "iq4_nl": _iq4nl,
    "iq4_xs": _iq4xs,
}

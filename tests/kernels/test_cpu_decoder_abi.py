"""The fused decoder's structs (kernels/csrc/cpu/decoder.cpp) and their ctypes mirrors
(kernels/cpu/decoder.py) agree: the same size, the same fields at the same offsets, in
the same order (the order is the ABI)."""

from __future__ import annotations

import ctypes

import pytest

from kernels.cpu.decoder import ABI_STRUCTS
from kernels.cpu.library import available, library

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")


def _python_layout(struct: type[ctypes.Structure]) -> list[int]:
    fields = [name for name, *_ in struct._fields_]
    return [ctypes.sizeof(struct), len(fields), *(getattr(struct, f).offset for f in fields)]


def test_the_decoder_structs_have_the_libraries_layout() -> None:
    out = (ctypes.c_int64 * 256)()
    library().hr_decoder_abi(out)
    at = 0
    for struct in ABI_STRUCTS:
        size, count = out[at], out[at + 1]
        layout = list(out[at : at + 2 + count])
        assert layout == _python_layout(struct), struct.__name__
        at += 2 + count
        assert size == ctypes.sizeof(struct)

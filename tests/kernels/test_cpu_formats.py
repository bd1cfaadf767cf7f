"""The weights' block formats have one record on each side of the language boundary:
kernels/cpu/quant.py FORMATS (whose block sizes are ggml's own, read through gguf) and
kernels/csrc/cpu/common.h kFormats. Both must give every format the same code, block
bytes, values per block and min rule."""

from __future__ import annotations

import ctypes

import pytest

from kernels.cpu.library import available, library
from kernels.cpu.quant import FORMATS, STACKED

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")


def _cpp_formats() -> dict[int, tuple[int, ...]]:
    """code -> (block_bytes, block_values, stored_min) of the C++ table."""
    out = (ctypes.c_int64 * 256)()
    library().hr_format_traits(out)
    return {code: tuple(out[1 + 3 * code : 4 + 3 * code]) for code in range(out[0])}


def test_the_python_and_cpp_format_tables_agree() -> None:
    python = {f.code: f for f in (*FORMATS.values(), STACKED)}
    cpp = _cpp_formats()
    assert sorted(cpp) == sorted(python)
    for code, (block_bytes, block_values, stored_min) in cpp.items():
        f = python[code]
        assert (block_bytes, block_values) == (f.block_bytes, f.block_values), f.name
        # A min per block of 32 (Q4_1, Q5_1): the int8 layout's second fp16 field.
        assert bool(stored_min) == (f.int8 and f.int8_layout[1] == 2), f.name


def test_each_format_is_the_ggml_type_of_its_name() -> None:
    for name, f in FORMATS.items():
        assert f.name == name and f.ggml_type.name.lower() == name
    assert len({f.ggml_type for f in FORMATS.values()}) == len(FORMATS)

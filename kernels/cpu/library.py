"""The CPU kernels' shared library (kernels/csrc/cpu/): built once, loaded, its C
signatures declared; and the tensor check every launcher runs before a pointer crosses.

The library is built by kernels/cpu/build.py and called through ctypes with plain
pointers, so it needs no torch headers. Each launcher (quant_linear.py, attention.py,
elementwise.py, moe.py, decoder.py: one per C++ file) checks dtypes, shapes and
contiguity (ValueError naming the argument) before a pointer crosses; the kernels trust
them. ``available()`` says whether this machine can run them at all.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from kernels.cpu import build as cpu_build
from kernels.log import get_logger

log = get_logger(__name__)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES = {
    "hr_quant_linear": (_I, _P, _I, _I, _P, _I, _P, _P),
    "hr_quant_linear_int8": (_I, _P, _I, _I, _P, _I, _P, _P),
    "hr_quant_linear_int8_tile16": (_I, _P, _I, _I, _P, _I, _P, _P),  # a test's check
    "hr_dequantize_rows": (_I, _P, _I, _P, _I, _P),
    "hr_dequantize_tiled": (_I, _P, _I, _P, _I, _P),
    "hr_format_traits": (_P,),  # the C++ table of the formats (a test's check)
    "hr_rms_norm": (_P, _P, _P, _I, _I, _F),
    "hr_add_rms_norm": (_P, _P, _P, _P, _I, _I, _F),
    "hr_head_rms_norm": (_P, _P, _I, _I, _I, _I, _F),
    "hr_silu_mul": (_P, _P, _I, _I),
    "hr_gelu_tanh_mul": (_P, _P, _I, _I),
    "hr_paged_attention": (_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, _F),
    "hr_rope_and_cache": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I),
    "hr_set_num_threads": (_I,),
    "hr_argmax_rows": (_P, _I, _I, _P),
    # tokens, h, inter, top_k, experts, sizes out
    "hr_moe_scratch_size": (_I, _I, _I, _I, _I, _P),
    # router, experts, x, tokens, h, top_k, normalize, probs scratch, ids, weights
    "hr_moe_route": (_P, _I, _P, _I, _I, _I, _I, _P, _P, _P),
    # table, experts, int8, x, tokens, h, inter, top_k, ids, weights, out, scratch, runs
    "hr_moe_experts": (_P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P),
    # router, experts, top_k, normalize, table, int8, x, tokens, h, inter, out, scratch, runs
    "hr_moe": (_P, _I, _I, _I, _P, _I, _P, _I, _I, _I, _P, _P, _P, _P),
    # LayerRow table, DecoderStatics, x, hidden, tokens, positions, AttentionStep, scratch
    "hr_decoder_layers": (_P, _P, _P, _P, _I, _P, _P, _P),
    "hr_decoder_abi": (_P,),  # sizes and offsets of the decoder's structs (a test's check)
}


@functools.cache
def _load() -> ctypes.CDLL | Exception:
    """The kernels for this CPU, built first if needed; or why they cannot be (once per
    process: a failed build is not retried at every call)."""
    try:
        isa = cpu_build.best_isa()
        if isa is None:
            raise cpu_build.BuildError("this CPU has neither AVX-512 nor AVX2")
        path = cpu_build.build(isa)
        lib = ctypes.CDLL(str(path))
    except (cpu_build.BuildError, OSError) as err:
        return err
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    log.info("cpu kernels loaded", isa=isa, path=str(path))
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernels; BuildError (or OSError) when this machine cannot have them."""
    lib = _load()
    if isinstance(lib, Exception):
        raise lib
    return lib


def available() -> bool:
    """True when the kernels build and load here; logs why not otherwise."""
    lib = _load()
    if isinstance(lib, Exception):
        log.warning("cpu kernels unavailable", reason=str(lib).splitlines()[0])
        return False
    return True


def use_torch_threads() -> None:
    """Run the kernels called from this thread on torch's thread count (OpenMP keeps one
    count per calling thread, and the step loop is not the thread that set torch's)."""
    library().hr_set_num_threads(torch.get_num_threads())


def check_tensor(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int | None, ...]) -> None:
    """ValueError naming `name` unless t is a contiguous CPU `dtype` tensor of `shape` (a
    None in `shape` accepts any size there)."""
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    if len(shape) != t.dim() or any(
        s is not None and s != n for s, n in zip(shape, t.shape, strict=True)
    ):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")

"""CuPy launchers for the paged-KV CUDA kernels in kernels/csrc.

The GPU twin of kernels/reference.py, with the same two functions:
``reshape_and_cache`` and ``paged_attention``. Each .cu is compiled once per
device with NVRTC (``cupy.RawModule``) and launched on torch's current stream;
tensors travel by ``data_ptr()`` once their dtype, shape, contiguity and device
have been checked (kernels/cuda/checks.py), scalars as numpy.int32 / numpy.float32.

Dispatch inside ``paged_attention``: rows of sequences with query_len == 1 go
to the decode kernel (split into partitions of 64 to 512 tokens chosen from the
batch and context, kernels/cuda/attention_plan.py, plus a merge kernel when any
sequence spans more than one); sequences with query_len >= 2 go to the
prefill kernel (or, with ``prefill_variant`` "sdpa", to torch SDPA over their gathered
pages: kernels/cuda/prefill_sdpa.py). Both kernels read query_start_loc on the device and skip the
other's sequences, so a mixed batch costs two or three launches and no index
lists, and a sequence gets the same kernel, hence the same bits, whatever
else shares its batch. Attention takes fp16 or bf16, head dim 64 or 128,
block size 16 or 32; the cache write takes fp16, bf16 or fp32.

A sliding ``window`` and a ``softcap`` (Gemma 2) are kernel arguments (0 = none), applied
as kernels/reference.py applies them: the query at position p sees keys p - window < k <= p,
and scores become tanh(s / softcap) * softcap after the scale, before the mask. With a
window the decode grid covers only the partitions a window can reach, and neither kernel
reads the blocks wholly before a query's window.

Trusted, not checked (checking would read device memory back): slot_mapping
values lie inside the cache, and block_tables / context_lens / query_start_loc
hold the values their host copies in AttentionMetadata describe.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kernels.cuda import prefill_sdpa
from kernels.cuda.attention_plan import AttentionPlan, plan_for
from kernels.cuda.checks import (
    ATTENTION_DTYPES,
    BLOCK_SIZES,
    CACHE_DTYPES,
    COPY_WORDS,
    HEAD_DIMS,
    check_tensor,
    copy_word,
)
from kernels.metadata import AttentionMetadata

CSRC = Path(__file__).parent.parent / "csrc"

# These mirror constants of the .cu files; the kernels assume them.
DECODE_THREADS = 128
PREFILL_ROWS = 64  # kPrefillRows, paged_attention_prefill.cu
PREFILL_THREADS = 128

_kernels: dict[tuple[str, int, tuple[str, ...], str], Any] = {}

# The decode kernel of paged_attention_decode.cu: "two-pass" (kernel 1: scores, softmax and
# values in barrier-separated phases) or "one-pass" (kernel 1b: online softmax, K and V read
# together, the next item prefetched). The same arguments, workspaces and merge kernel; the
# outputs differ by rounding. Neither has run on a GPU yet: bench/gpu/cuda_kernels.py times
# both in one run so the first GPU session can keep the faster. A process-wide setting
# (benchmarks and tests set it), fixed before any CUDA graph is captured.
DECODE_VARIANTS = ("two-pass", "one-pass")
decode_variant = "two-pass"
ONEPASS_GROUPS = (4, 8)  # the one-pass kernel's query-head capacities (its G)

# The prefill of sequences with query_len >= 2: "cupy" (paged_attention_prefill.cu, fp32 on
# CUDA cores) or "sdpa" (kernels/cuda/prefill_sdpa.py: torch SDPA over the gathered pages,
# flash / memory-efficient kernels on tensor cores; soft-capped calls keep "cupy", SDPA
# cannot cap). Process-wide as decode_variant; a GPU run measures both (bench/gpu/
# cuda_kernels.py --prefill) before the engine's default changes.
PREFILL_VARIANTS = ("cupy", "sdpa")
prefill_variant = "cupy"


def is_available() -> bool:
    """True when a CUDA device and CuPy are both present."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def has_cupy() -> bool:
    """True when CuPy imports (whether or not a GPU is present)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "CuPy is not installed: pip install cupy-cuda13x (or headrace[gpu]) "
            "to run the CUDA kernels; CPU tensors use kernels.reference"
        ) from exc
    return cupy


def _require_gpu(t: Tensor, name: str) -> None:
    """The launchers' entry check: CuPy, a CUDA runtime, and a CUDA tensor."""
    _import_cupy()
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: kernels.cuda needs an NVIDIA GPU")
    if not isinstance(t, Tensor) or t.device.type != "cuda":
        where = t.device if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a CUDA tensor, got {where}")


def decode_kernel_name(
    dtype_suffix: str, head_dim: int, block_size: int, group: int = 8, variant: str | None = None
) -> str:
    """The decode kernel for these sizes; the one-pass kernel's G is the smallest of
    ONEPASS_GROUPS that holds the group (thread blocks serve at most 8 of its heads)."""
    variant = variant or decode_variant
    if variant == "two-pass":
        return f"paged_attention_decode_{dtype_suffix}_d{head_dim}_b{block_size}"
    if variant != "one-pass":
        raise ValueError(f"decode variant must be one of {DECODE_VARIANTS}, got {variant!r}")
    capacity = next(g for g in ONEPASS_GROUPS if min(group, 8) <= g)
    return f"paged_attention_decode_onepass_{dtype_suffix}_d{head_dim}_b{block_size}_g{capacity}"


def reduce_kernel_name(dtype_suffix: str, head_dim: int) -> str:
    return f"paged_attention_decode_reduce_{dtype_suffix}_d{head_dim}"


def prefill_kernel_name(dtype_suffix: str, head_dim: int) -> str:
    return f"paged_attention_prefill_{dtype_suffix}_d{head_dim}"


def kernel_names() -> dict[str, list[str]]:
    """Every entry point the launchers may call, by source file (the compile test checks them)."""
    names: dict[str, list[str]] = {
        "reshape_and_cache.cu": [f"reshape_and_cache_{w}" for _, w in COPY_WORDS],
        "paged_attention_decode.cu": [],
        "paged_attention_prefill.cu": [],
    }
    for t in ATTENTION_DTYPES.values():
        for d in HEAD_DIMS:
            for b in BLOCK_SIZES:
                names["paged_attention_decode.cu"] += dict.fromkeys(
                    decode_kernel_name(t, d, b, g, v) for v in DECODE_VARIANTS for g in (4, 8)
                )
            names["paged_attention_decode.cu"].append(reduce_kernel_name(t, d))
            names["paged_attention_prefill.cu"].append(prefill_kernel_name(t, d))
    return names


def _ptr(t: Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- compile, launch


def _cuda_include_dir() -> Path | None:
    """Where cuda_fp16.h lives: a CUDA toolkit, else the nvidia-* wheels torch brings along."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    try:
        import nvidia  # namespace package of the nvidia-cuda-* wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for header in sorted(Path(base).glob("*/include/cuda_fp16.h")):
            return header.parent
    return None


@functools.cache
def _compile_options() -> tuple[str, ...]:
    # NVRTC has no default include path: cuda_fp16.h / cuda_bf16.h must be found through -I
    # (recent CuPy adds one itself; a second is harmless).
    include = _cuda_include_dir()
    return ("--std=c++17",) + ((f"-I{include}",) if include else ())


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.MULTILINE)


def kernel_source(file: str) -> str:
    """csrc/`file` with its local headers pasted in.

    CuPy's on-disk kernel cache is keyed by the source text alone, so a header included by
    path could change without the cache noticing; pasted in, every byte is in the key.
    """
    text = (CSRC / file).read_text()
    header = lambda m: (CSRC / m.group(1)).read_text().replace("#pragma once\n", "")  # noqa: E731
    return _LOCAL_INCLUDE.sub(header, text)


def _kernel(cupy: Any, file: str, name: str, device_index: int) -> Any:
    """The compiled kernel `name` of csrc/`file` on a device, compiled on first use."""
    options = _compile_options()
    key = (file, device_index, options, name)
    kernel = _kernels.get(key)
    if kernel is None:
        with cupy.cuda.Device(device_index):
            module_key = (file, device_index, options, "")
            module = _kernels.get(module_key)
            if module is None:
                module = cupy.RawModule(code=kernel_source(file), options=options)
                _kernels[module_key] = module
            kernel = module.get_function(name)
        _kernels[key] = kernel
    return kernel


def _launch(
    device: torch.device,
    file: str,
    name: str,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: tuple[Any, ...],
) -> None:
    """Launches csrc/`file`:`name` on torch's current stream of `device`."""
    cupy = _import_cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _kernel(cupy, file, name, index)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        kernel(grid, block, args)


# ----------------------------------------------------------------------------- cache write


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into caches [N, B, Hkv, D] at ``slot_mapping`` (-1 skipped)."""
    _require_gpu(key, "key")
    if key.dtype not in CACHE_DTYPES:
        raise ValueError(f"key must be one of {CACHE_DTYPES}, got {key.dtype}")
    device = key.device
    check_tensor("key", key, key.dtype, (None, None, None), device)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, key.dtype, tuple(key.shape), device)
    check_tensor("key_cache", key_cache, key.dtype, (None, None, num_kv_heads, head_dim), device)
    check_tensor("value_cache", value_cache, key.dtype, tuple(key_cache.shape), device)
    check_tensor("slot_mapping", slot_mapping, torch.int64, (num_tokens,), device)
    if num_tokens == 0:
        return
    row_bytes = num_kv_heads * head_dim * key.element_size()
    width, suffix = copy_word(row_bytes, (key, value, key_cache, value_cache))
    words = row_bytes // width
    threads = min(256, _cdiv(words, 32) * 32)
    args = (_ptr(key), _ptr(value), _ptr(key_cache), _ptr(value_cache), _ptr(slot_mapping))
    _launch(
        device,
        "reshape_and_cache.cu",
        f"reshape_and_cache_{suffix}",
        (num_tokens, 1, 1),
        (threads, 1, 1),
        (*args, np.int32(words)),
    )


# ----------------------------------------------------------------------------- attention


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attend query [T, H, D] over the paged cache; returns [T, H, D] in the query dtype.

    ``window``: each query sees only the last ``window`` keys up to its position (itself
    included); ``softcap``: scores become tanh(s / softcap) * softcap (None: neither).
    Rows no sequence owns come back as zeros, as do rows of sequences with context_len 0.
    The arguments are checked, and the launches planned, once per metadata object
    (kernels/cuda/attention_plan.py): the other layers of a step reuse the plan.
    """
    _require_gpu(query, "query")
    scores = _score_args(scale, window, softcap)
    plan = plan_for(query, key_cache, value_cache, meta)
    if meta.num_seqs == 0:
        return torch.zeros_like(query)
    out = torch.empty_like(query) if plan.covered else torch.zeros_like(query)
    if plan.decode_partitions:
        _launch_decode(out, query, key_cache, value_cache, meta, scores, plan)
    if plan.prefill_longest and _prefill_by_sdpa(softcap):
        prefill_sdpa.prefill_attention(out, query, key_cache, value_cache, meta, scale, window)
    elif plan.prefill_longest:
        _launch_prefill(out, query, key_cache, value_cache, meta, scores, plan)
    return out


def _prefill_by_sdpa(softcap: float | None) -> bool:
    """Whether this call's prefill sequences go to torch SDPA (prefill_variant)."""
    if prefill_variant not in PREFILL_VARIANTS:
        raise ValueError(
            f"prefill variant must be one of {PREFILL_VARIANTS}, got {prefill_variant!r}"
        )
    return prefill_variant == "sdpa" and softcap is None


def _score_args(
    scale: float, window: int | None, softcap: float | None
) -> tuple[np.float32, np.float32, np.int32]:
    """The kernels' (scale_log2, softcap_log2, window): scores are computed in base 2, so
    the scale and the cap are both taken times log2(e); 0 is no cap, no window."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be an int or None, got {type(window).__name__}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")
    log2e = math.log2(math.e)
    return (
        np.float32(scale * log2e),
        np.float32(softcap * log2e if softcap is not None else 0.0),
        np.int32(min(window or 0, 2**31 - 1)),  # longer than any context: the same as none
    )


def _launch_decode(out, query, key_cache, value_cache, meta, scores, p: AttentionPlan):
    """Decode kernel over every sequence (it serves those with query_len 1), then the merge."""
    window = int(scores[2])
    parts, size = p.decode_partitions_within(window), p.decode_partition_size
    ws_out = ws_max = ws_sum = None  # one partition each: the kernel writes `out` directly
    if parts > 1:
        ws_shape = (meta.num_seqs, p.num_heads, parts)
        ws_out = torch.empty((*ws_shape, p.head_dim), dtype=torch.float32, device=query.device)
        ws_max = torch.empty(ws_shape, dtype=torch.float32, device=query.device)
        ws_sum = torch.empty(ws_shape, dtype=torch.float32, device=query.device)
    tables = (meta.block_tables, meta.context_lens, meta.query_start_loc)
    name = decode_kernel_name(p.dtype_suffix, p.head_dim, p.block_size, p.group)
    grid = (p.num_kv_heads * p.group_chunks, meta.num_seqs, parts)
    args = (
        *map(_ptr, (out, ws_out, ws_max, ws_sum, query, key_cache, value_cache, *tables)),
        *scores,
        *map(np.int32, (p.num_kv_heads, p.group, p.table_width, parts, size)),
    )
    file = "paged_attention_decode.cu"
    _launch(query.device, file, name, grid, (DECODE_THREADS, 1, 1), args)
    if parts > 1:
        name = reduce_kernel_name(p.dtype_suffix, p.head_dim)
        args = (
            *map(_ptr, (out, ws_out, ws_max, ws_sum, meta.context_lens, meta.query_start_loc)),
            *map(np.int32, (window, p.num_heads, parts, size)),
        )
        grid = (p.num_heads, meta.num_seqs, 1)
        _launch(query.device, file, name, grid, (p.head_dim, 1, 1), args)


def _launch_prefill(out, query, key_cache, value_cache, meta, scores, p: AttentionPlan):
    """Prefill kernel over every sequence (it serves those with query_len >= 2)."""
    tables = (meta.block_tables, meta.context_lens, meta.query_start_loc)
    name = prefill_kernel_name(p.dtype_suffix, p.head_dim)
    grid = (_cdiv(p.prefill_longest * p.group, PREFILL_ROWS), meta.num_seqs, p.num_kv_heads)
    args = (
        *map(_ptr, (out, query, key_cache, value_cache, *tables)),
        *scores,
        *map(np.int32, (p.num_kv_heads, p.group, p.block_size, p.table_width)),
    )
    file = "paged_attention_prefill.cu"
    _launch(query.device, file, name, grid, (PREFILL_THREADS, 1, 1), args)


# ----------------------------------------------------------------------------- warm-up


def kernels_for(dtype: torch.dtype, head_dim: int, block_size: int) -> list[tuple[str, str]]:
    """(file, kernel) of every launch a model of these sizes can make."""
    suffix = ATTENTION_DTYPES[dtype]
    decode = {decode_kernel_name(suffix, head_dim, block_size, g) for g in ONEPASS_GROUPS}
    return [
        *(("reshape_and_cache.cu", f"reshape_and_cache_{w}") for _, w in COPY_WORDS),
        *(("paged_attention_decode.cu", name) for name in sorted(decode)),
        ("paged_attention_decode.cu", reduce_kernel_name(suffix, head_dim)),
        ("paged_attention_prefill.cu", prefill_kernel_name(suffix, head_dim)),
    ]


def warm_up(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> int:
    """Compiles (or loads from CuPy's disk cache) and loads every kernel the model can call,
    so that the first step, and a CUDA graph capture, pay none of it. Returns the count."""
    cupy = _import_cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = kernels_for(dtype, head_dim, block_size)
    for file, name in wanted:
        _kernel(cupy, file, name, index)
    return len(wanted)


def compile_all(device: torch.device) -> dict[str, tuple[int, float]]:
    """Compiles (or loads from CuPy's disk cache) every entry point of kernel_names() on a
    device: {file: (kernels, seconds)}. gpu_check.sh's compile step times it, so the kernel
    tests that follow (other processes, the same disk cache) do not pay it in their limits."""
    cupy = _import_cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    took = {}
    for file, names in kernel_names().items():
        start = time.perf_counter()
        for name in names:
            _kernel(cupy, file, name, index)
        took[file] = (len(names), time.perf_counter() - start)
    return took

"""The two paged-KV operations the model calls, dispatched by device.

CUDA tensors go to the CuPy RawKernels (kernels/cuda/launch.py), CPU tensors to the
torch reference (kernels/reference.py): the test oracle, and the CPU fallback
(``--cpu-kernels torch``, or where the CPU kernels cannot be built). On the CPU
kernels (kernels/cpu/) the model calls them itself and does not come here.
There is no silent fallback on CUDA: a CUDA tensor without CuPy is an error, and
``check_backend`` says so (with every other thing the kernels cannot serve) when
the engine starts, not at its first step.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cuda import launch as cuda
from kernels.cuda.checks import ATTENTION_DTYPES, BLOCK_SIZES, HEAD_DIMS
from kernels.log import get_logger
from kernels.metadata import AttentionMetadata

log = get_logger(__name__)

REFERENCE = "torch-reference"
CPU_KERNELS = "cpu-kernels"
CUDA = "cuda-cupy"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's K/V [T, Hkv, D] into the paged caches; slot -1 is skipped."""
    impl = cuda if key.is_cuda else reference
    impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the flat batch's queries [T, Hq, D] over their sequences' caches; a
    ``window`` / ``softcap`` as kernels/reference.py applies them (the CUDA kernels take
    both as kernel arguments)."""
    if query.is_cuda:
        return cuda.paged_attention(query, key_cache, value_cache, meta, scale, window, softcap)
    if window is None and softcap is None:  # the plain call, as every backend takes it
        return reference.paged_attention(query, key_cache, value_cache, meta, scale)
    return reference.paged_attention(query, key_cache, value_cache, meta, scale, window, softcap)


def check_backend(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    native_cpu: bool = False,
) -> str:
    """The attention backend for a model of these sizes on `device`, ready to run.

    On the CPU: the CPU kernels (kernels/cpu/) when ``native_cpu``, else the torch
    reference.
    On CUDA: ValueError naming the option (--dtype, --block-size) or the model's head dim
    when the kernels have no instantiation for it, RuntimeError when CuPy is missing; then
    every kernel the model can call is compiled and loaded (cuda.warm_up). Logs the choice.
    """
    if device.type != "cuda":
        backend = CPU_KERNELS if native_cpu else REFERENCE
        log.info("attention backend", backend=backend, device=str(device), dtype=_name(dtype))
        return backend
    _check_cuda_sizes(dtype, head_dim, num_heads, num_kv_heads, block_size)
    if not cuda.has_cupy():
        raise RuntimeError(
            "CuPy is not installed, and --device cuda runs attention only through the CuPy "
            "kernels: pip install 'headrace[gpu]' (CUDA 13) or 'headrace[gpu-cuda12]', "
            "or make setup-gpu"
        )
    count = cuda.warm_up(device, dtype, head_dim, block_size)
    log.info(
        "attention backend",
        backend=CUDA,
        device=str(device),
        dtype=_name(dtype),
        head_dim=head_dim,
        block_size=block_size,
        kernels_loaded=count,
    )
    return CUDA


def _check_cuda_sizes(
    dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    """ValueError naming the option (--dtype, --block-size) or the model's sizes that the
    CUDA kernels have no instantiation for."""
    if dtype not in ATTENTION_DTYPES:
        names = ", ".join(str(t).removeprefix("torch.") for t in ATTENTION_DTYPES)
        raise ValueError(
            f"dtype: the CUDA attention kernels take {names}, got "
            f"{str(dtype).removeprefix('torch.')} (use --dtype bfloat16 or float16)"
        )
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size: the CUDA attention kernels take {' or '.join(map(str, BLOCK_SIZES))}"
            f" tokens per block, got {block_size} (use --block-size 16 or 32)"
        )
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"model: the CUDA attention kernels take head dim {' or '.join(map(str, HEAD_DIMS))}"
            f", this model has {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"model: {num_heads} query heads are not a multiple of {num_kv_heads}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

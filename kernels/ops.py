"""The two paged-KV operations the model calls, dispatched by device.

CUDA tensors go to the CuPy RawKernels (kernels/cuda.py) when CuPy is
installed; everything else runs the torch reference (kernels/reference.py),
which is both the CPU production path and the test oracle.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

_cuda_ops = None


def _use_cuda(t: torch.Tensor) -> bool:
    global _cuda_ops
    if not t.is_cuda:
        return False
    if _cuda_ops is None:
        from kernels import cuda

        _cuda_ops = cuda if cuda.is_available() else False
    return bool(_cuda_ops)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's K/V [T, Hkv, D] into the paged caches; slot -1 is skipped."""
    impl = _cuda_ops if _use_cuda(key) else reference
    impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the flat batch's queries [T, Hq, D] over their sequences' caches."""
    impl = _cuda_ops if _use_cuda(query) else reference
    return impl.paged_attention(query, key_cache, value_cache, meta, scale)

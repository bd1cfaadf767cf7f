"""Host lists to device tensors without waiting for the device.

``torch.tensor(data, device="cuda")`` copies from pageable memory, and a blocking copy
ends with a stream synchronize: the host would wait for every kernel already queued,
so a step's inputs could not be built while the previous step runs (asynchronous
output, compute/engine.py). Built in pinned memory and copied with ``non_blocking``,
the copy is queued behind that work instead; torch's pinned-memory allocator keeps the
host buffer until the copy has run. On the CPU this is plain ``torch.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def device_tensor(
    data: Sequence[Any], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)``, queued rather than waited for."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)

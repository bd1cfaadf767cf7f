"""Keep glibc from handing the step's large temporaries back to the OS.

Each CPU step allocates and frees buffers of a few MB (gathered K/V, scores,
activations). By default glibc serves those with mmap and returns them with
munmap, and re-trims the heap after frees, so every step touches fresh pages:
on VMs that page-fault cost can exceed the math (measured: a batch-16 decode
attention went from 4 ms to 24 ms). Raising both thresholds keeps the memory
in the heap for reuse. The same effect as MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_, but set at run time so every entry point gets it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kernels.log import get_logger

log = get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 4 * 1024**3
_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once; False where libc is not glibc (nothing to do)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("mallopt refused the allocator thresholds; CPU steps may be slower")
    _done = ok
    return ok

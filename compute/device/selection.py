"""Where and how the engine runs: the device and dtype, CPU kernels or torch, the threads.

The one place for the process-level policies the engine applies when it is built: which
device and dtype ``auto`` means, whether the C++ CPU kernels and which weight mode serve
the model, how many CPU threads step it (compute/device/threads.py) and the allocator
thresholds that keep a CPU step's temporaries in the heap (compute/device/allocator.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from compute.core.config import DeviceConfig
from compute.device.allocator import keep_freed_memory
from compute.device.threads import available_cpus, default_threads
from kernels.cpu.library import available
from kernels.log import get_logger

log = get_logger(__name__)


@contextmanager
def building_threads(cfg: DeviceConfig, device: torch.device) -> Iterator[None]:
    """Build the engine on one thread, then leave torch on the threads that step it."""
    threads = cfg.num_threads or torch.get_num_threads()
    if device.type != "cpu":
        yield
        return
    available = available_cpus()
    if cfg.num_threads is None:  # the CPUs this process may use
        threads = default_threads(threads)
    elif threads > available:
        log.warning(
            "more CPU threads than CPUs this process may use: they spin-wait for "
            "each other at every step (docs/deploying.md: Several replicas on one host)",
            threads=threads,
            available=available,
        )
    log.info("cpu threads", threads=threads, available=available)
    keep_freed_memory()
    # Built on one thread, so that the constructing thread owns no OpenMP team: the
    # server constructs here and steps in the step-loop thread, and with a second team in
    # the process libgomp throttles its spin-waits (more threads than CPUs), so every
    # kernel's fork-join paid a futex wake-up: a served decode step took ~14 ms instead
    # of ~8 on the 2-core machine.
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cpu_execution(cfg: DeviceConfig, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(native, weights): run on the CPU kernels? which weight mode (never "auto")?
    ValueError naming the option when what was asked cannot run here."""
    fits = device.type == "cpu" and dtype == torch.float32
    if cfg.cpu_kernels == "native" and not fits:
        raise ValueError("cpu_kernels: the CPU kernels run on the CPU in float32 only")
    if cfg.cpu_kernels == "native" and not available():
        raise ValueError("cpu_kernels: the CPU kernels cannot be built here (see the log)")
    native = cfg.cpu_kernels == "native" or (cfg.cpu_kernels == "auto" and fits and available())
    if cfg.weights.startswith("quantized") and not native:
        raise ValueError("weights: quantized weights need the CPU kernels (--cpu-kernels native)")
    if cfg.weights == "auto":
        return native, "quantized" if native else "dense"
    return native, cfg.weights


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto' picks CUDA when present; fp32 on CPU, bf16 on GPU unless told otherwise."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but torch sees no CUDA device")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, dtype)

"""Where the server's resident memory goes: model tensors, KV cache, the rest.

Logged once by the engine after loading (one ``memory`` line), so a reader of the
start-up log, and the soak benchmark (bench/soak/), can tell weights from KV cache from
everything else (Python, torch's libraries, the tokenizer, allocator slack) in the
process's RSS.

The walk is generic on purpose: it sums every tensor reachable from an object's
attributes (lists, tuples, dicts, dataclasses, plain objects), deduplicated by storage, so
it keeps working when the model's layout changes (fused or quantized weights, extra
transposed copies, new cache fields). A tensor shared by two owners (tied embeddings) or
viewed twice (a slice of a fused matrix) counts once, with its whole storage.

On a GPU the line also has the device's memory as the driver sees it once the CUDA graphs
are captured (``gpu_mib``: total, free, and the fraction in use, to hold against
--gpu-memory-utilization, which sized the KV cache: compute/runner/kv_sizing.py).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kernels.log import get_logger

log = get_logger(__name__)

MIB = 1024**2
# Leaves that hold no tensors (and, for modules and functions, whole worlds not to walk).
_ATOMS = (
    str, bytes, bytearray, int, float, complex, bool, type(None), type, range,
    types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    torch.device, torch.dtype,
)  # fmt: skip


def _children(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, list | tuple | set | frozenset):
        yield from obj
    else:
        yield from getattr(obj, "__dict__", {}).values()
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    yield getattr(obj, name)


def reachable_tensors(root: Any, skip: tuple[Any, ...] = ()) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root``'s attributes, not descending into ``skip``."""
    seen = {id(s) for s in skip}
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        stack.extend(c for c in _children(obj) if not isinstance(c, _ATOMS))


def _storage_key(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    """((device, storage address), storage bytes); a tensor without one counts by itself."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr() or id(storage)), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return (str(t.device), id(t)), t.numel() * t.element_size()


def tensor_bytes(root: Any, skip: tuple[Any, ...] = (), exclude: set | None = None) -> dict:
    """Bytes of the distinct storages reachable from ``root``, by device. Storages whose key
    is in ``exclude`` are left out; every key counted is added to it (for a later call)."""
    counted = set() if exclude is None else exclude
    by_device: dict[str, int] = {}
    for t in reachable_tensors(root, skip):
        key, nbytes = _storage_key(t)
        if key in counted:
            continue
        counted.add(key)
        by_device[key[0]] = by_device.get(key[0], 0) + nbytes
    return by_device


def process_rss_bytes(pid: int | str = "self") -> int | None:
    """VmRSS of a process from /proc (Linux); None where there is no /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver reports them (tests fake it)."""
    return torch.cuda.mem_get_info(device)


def _gpu_report(runner: Any) -> dict[str, Any] | None:
    device = getattr(runner, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    free, total = gpu_memory(device)
    return {"total": total, "free": free, "in_use_fraction": round(1 - free / total, 3)}


def memory_breakdown(model: Any, runner: Any) -> dict[str, Any]:
    """Model tensors, then the runner's own tensors (KV cache and the rest) by attribute,
    the process RSS with what these leave unexplained on the CPU, and on a GPU the device's
    memory (``gpu``: bytes total and free, fraction in use; None elsewhere)."""
    counted: set = set()
    model_bytes = tensor_bytes(model, exclude=counted)
    by_attribute = {}
    for name, value in vars(runner).items():
        found = tensor_bytes(value, skip=(model,), exclude=counted)
        if found:
            by_attribute[name] = found
    kv = _sum_devices(v for name, v in by_attribute.items() if "cache" in name)
    rss = process_rss_bytes()
    cpu_tensors = model_bytes.get("cpu", 0) + sum(v.get("cpu", 0) for v in by_attribute.values())
    return {
        "model_bytes": model_bytes,
        "kv_cache_bytes": kv,
        "runner_bytes_by_attribute": by_attribute,
        "rss_bytes": rss,
        "rss_other_bytes": None if rss is None else rss - cpu_tensors,
        "gpu": _gpu_report(runner),
    }


def _sum_devices(parts) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for device, nbytes in part.items():
            total[device] = total.get(device, 0) + nbytes
    return total


def log_memory(model: Any, runner: Any) -> dict[str, Any]:
    """Log the breakdown as one ``memory`` line (MiB, by device) and return it in bytes."""
    report = memory_breakdown(model, runner)

    def mib(by_device: dict[str, int]) -> dict[str, float]:
        return {device: round(n / MIB, 1) for device, n in by_device.items()}

    rss, other, gpu = report["rss_bytes"], report["rss_other_bytes"], report["gpu"]
    log.info(
        "memory",
        model_mib=mib(report["model_bytes"]),
        kv_cache_mib=mib(report["kv_cache_bytes"]),
        runner_other_mib={
            name: mib(v) for name, v in report["runner_bytes_by_attribute"].items()
            if "cache" not in name
        },
        rss_mib=None if rss is None else round(rss / MIB, 1),
        rss_other_mib=None if other is None else round(other / MIB, 1),
        **({} if gpu is None else {"gpu_mib": {
            "total": round(gpu["total"] / MIB), "free": round(gpu["free"] / MIB),
            "in_use_fraction": gpu["in_use_fraction"],
        }}),
    )  # fmt: skip
    return report

"""Refuse at load a model whose weights cannot fit in the memory this process may use.

A mixture-of-experts model holds every expert in memory while each token reads a few, so
it is easy to pick one larger than the machine: without this check the loader reads
weights until the OS kills the process halfway (no error, no log line). The loaders
count the bytes the weights will take from the file's header (before reading any) and
call ``check_fits``, which compares them with what is available: the kernel's
MemAvailable and, in a container, the cgroup's limit minus its current usage.
"""

from __future__ import annotations

from pathlib import Path

from compute.loaders.base import ModelLoadError

GIB = 1024**3
_CGROUP = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    """Bytes left under the cgroup's memory limit (v2, then v1); None without a limit."""
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_int(_CGROUP / limit), _read_int(_CGROUP / usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 says "no limit" so
            return max(cap - used, 0)
    return None


def available_bytes() -> int | None:
    """Memory this process can still take: the smaller of MemAvailable and the cgroup's
    room; None where neither can be read (then nothing is checked)."""
    known = [n for n in (_mem_available(), _cgroup_room()) if n is not None]
    return min(known) if known else None


def check_fits(needed: int, source: str, what: str = "its weights") -> None:
    """ModelLoadError naming both figures when ``needed`` bytes exceed what is available."""
    available = available_bytes()
    if available is not None and needed > available:
        raise ModelLoadError(
            f"{source}: the model needs {needed:,} bytes ({needed / GIB:.2f} GiB) for {what}, "
            f"but only {available:,} bytes ({available / GIB:.2f} GiB) of memory are "
            "available (MemAvailable, cgroup limit); refused at load instead of being "
            "killed by the OS halfway. Use a smaller quantization, --weights quantized "
            "for a GGUF file, or a machine with more memory"
        )

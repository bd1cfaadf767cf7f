"""Builds the CPU kernels (kernels/csrc/cpu/*.cpp) into a shared library, once per machine.

The sources are plain C++ (no torch headers), compiled with the system's g++ in a few
seconds. One library per instruction-set level, chosen from what this CPU reports:

- ``avx512vnni``: ``-march=x86-64-v4 -mavx512vnni``, the fast path (AVX-512 with VNNI's
  int8 dot product: Ice Lake, Sapphire Rapids, Zen 4 and later);
- ``avx512``: ``-march=x86-64-v4`` (AVX-512 F/BW/DQ/VL);
- ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, F16C), everything else from the last decade.

Libraries are cached under ``HEADRACE_KERNEL_DIR`` (default ``~/.cache/headrace/kernels``),
named by ISA and a hash of the sources and flags, so an edited source rebuilds and a
stale one is never loaded. ``python -m kernels.cpu.build [--all]`` builds ahead of time
(``make setup`` and the Docker image do; ``--all`` builds every ISA level, for an image
that may run on another CPU). OpenMP comes from torch's own libgomp when torch is loaded
first (same soname), so the kernels and torch share one thread pool.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).parent.parent / "csrc" / "cpu"
COMMON_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-maybe-uninitialized",  # GCC 12's own AVX-512 headers trip it
    "-Wno-psabi",
)
# ISA level -> (compiler flags, /proc/cpuinfo flags the CPU must report), best first.
_AVX512 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c")
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # VNNI: one vpdpbusd per 32 int8 products instead of maddubs + madd (int8 activations).
    "avx512vnni": (("-march=x86-64-v4", "-mavx512vnni"), (*_AVX512, "avx512_vnni")),
    "avx512": (
        ("-march=x86-64-v4",),
        _AVX512,
    ),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
}


class BuildError(RuntimeError):
    """The CPU kernels cannot be built or loaded here (no compiler, unsupported CPU, ...)."""


def cpu_flags() -> set[str]:
    """The feature flags of this CPU (empty when /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def best_isa(flags: set[str] | None = None) -> str | None:
    """The best ISA level this CPU runs, or None when it has none of them."""
    flags = cpu_flags() if flags is None else flags
    for name, (_, required) in ISA_LEVELS.items():
        if all(f in flags for f in required):
            return name
    return None


def kernel_dir() -> Path:
    configured = os.environ.get("HEADRACE_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "headrace" / "kernels"


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def library_path(isa: str) -> Path:
    """Where the library of `isa` for the current sources lives (built or not)."""
    digest = hashlib.sha256()
    for path in [*sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(COMMON_FLAGS + ISA_LEVELS[isa][0]).encode())
    return kernel_dir() / f"headrace_cpu-{isa}-{digest.hexdigest()[:16]}.so"


def build(isa: str, compiler: str | None = None) -> Path:
    """The library for `isa`, compiled now unless already cached. BuildError on failure."""
    target = library_path(isa)
    if target.is_file():
        return target
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuildError(f"cannot create {target.parent}: {err} (set HEADRACE_KERNEL_DIR)") from err
    # Compile to a temporary name and rename, so concurrent builds never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *COMMON_FLAGS, *ISA_LEVELS[isa][0], *map(str, sources()), "-o", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError(f"compiling the CPU kernels failed:\n{result.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description="Build headrace's CPU kernels ahead of time.")
    parser.add_argument("--all", action="store_true", help="every ISA level, not just this CPU's")
    args = parser.parse_args()
    levels = list(ISA_LEVELS) if args.all else [best_isa()]
    if levels == [None]:
        raise SystemExit("this CPU has neither AVX-512 nor AVX2: the CPU kernels cannot run here")
    for isa in levels:
        print(f"{isa}: {build(isa)}")


if __name__ == "__main__":
    main()

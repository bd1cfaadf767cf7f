"""gpu_check.sh's `compile` step: NVRTC-compile every kernel the launcher can build, timed.

kernels/cuda/launch.py compiles each .cu once per device on first use (cupy.RawModule);
CuPy keeps the cubins in its disk cache (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache),
so the kernel and engine tests run after this step load them instead of compiling inside
their own time limits. Prints the seconds per file and in all (a warm disk cache shows as
well under a second a file). tests/kernels/test_cuda_compile.py compiles the same source
with NVRTC on the CPU.

Run: ``python -m bench.gpu.compile_kernels``.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    from kernels.cuda import launch

    if not launch.is_available():
        print("compile: no CUDA device or no CuPy (see the ready step)")
        return 3
    start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    cache = os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")
    print(f"compile: sm_{major}{minor}, options {launch._compile_options()}, cache {cache}")
    for file, (count, seconds) in launch.compile_all(device).items():
        print(f"compile: {file}: {count} kernels in {seconds:.1f} s", flush=True)
    print(f"compile: all in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

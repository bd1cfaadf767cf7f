"""gpu_check.sh's `ready` step: is there a CUDA device and CuPy for kernels/cuda?

Without both, every gpu-marked test skips and pytest passes, so the device call stops here.
Exit status: 0 ready; NOT_READY (3) with a line saying what is missing; anything else is a
fault of this check (a Python error: a traceback and exit 1), which gpu_check.sh reports as
such, never as "no GPU".

Run: ``python -m bench.gpu.ready``.
"""

from __future__ import annotations

import sys

NOT_READY = 3


def main() -> int:
    import torch

    from kernels.cuda import launch

    if launch.is_available():
        import cupy

        name = torch.cuda.get_device_name(0)
        print(f"ready: {name}, torch {torch.__version__}, CuPy {cupy.__version__}")
        return 0
    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA device (torch.cuda.is_available() is False)")
    if not launch.has_cupy():
        missing.append("no CuPy (import cupy fails)")
    print("NOT READY: " + "; ".join(missing), flush=True)
    return NOT_READY


if __name__ == "__main__":
    sys.exit(main())

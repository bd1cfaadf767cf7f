"""The host emulation of the CUDA kernels: kernels/csrc built for the CPU by g++.

Each .cu is compiled with tests/support/cuda_host/host_emulation.cuh force-included (threads
as fibers, barriers and warp shuffles emulated, fibers run in random order) into a
shared library with one ``emu_<kernel>`` entry per kernel; ``Emulator.launch`` has the
signature of ``kernels.cuda.launch._launch`` so a test can substitute it.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from kernels.cuda import launch as cuda


def cuda_include() -> Path | None:
    for root in ("/usr/local/cuda", "/usr/local/cuda-13.0", "/opt/cuda"):
        if (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    return None


class Emulator:
    """kernels/csrc built for the host by g++; `launch` replaces kernels.cuda.launch._launch."""

    def __init__(self, build_dir: Path, include: Path):
        self.build_dir, self.include = build_dir, include
        self.libraries: dict[Path, ctypes.CDLL] = {}
        self.sources: dict[str, Path] = {}  # file name -> another source to build instead
        self.seed = itertools.count(1)

    def _flags(self) -> list[str]:
        header = Path(__file__).parent / "host_emulation.cuh"
        return [
            "-std=c++17",
            "-x",
            "c++",
            f"-I{self.include}",
            f"-I{cuda.CSRC}",
            "-include",
            str(header),
        ]

    def _build(self, source: Path) -> ctypes.CDLL:
        pre = subprocess.run(
            ["g++", "-E", *self._flags(), str(source)], capture_output=True, text=True, check=True
        ).stdout
        lines = [f'#include "{source}"']
        for name in re.findall(r'extern\s+"C"\s+void\s+(\w+)\s*\(', pre):
            lines.append(
                f'extern "C" const char* emu_{name}(unsigned gx, unsigned gy, unsigned gz, '
                f"unsigned bx, void** args, unsigned seed) {{ return hr_emu::launch({name}, "
                f"dim3(gx, gy, gz), dim3(bx, 1, 1), args, seed); }}"
            )
        wrapper = self.build_dir / f"{source.stem}.emu.cpp"
        wrapper.write_text("\n".join(lines) + "\n")
        library = self.build_dir / f"{source.stem}.emu.so"
        command = [
            "g++",
            "-O2",
            "-fPIC",
            "-shared",
            *self._flags(),
            str(wrapper),
            "-o",
            str(library),
        ]
        subprocess.run(command, capture_output=True, text=True, check=True)
        return ctypes.CDLL(str(library))

    def launch(self, device, file, name, grid, block, args) -> None:
        source = self.sources.get(file, cuda.CSRC / file)
        if source not in self.libraries:
            self.libraries[source] = self._build(source)
        function = getattr(self.libraries[source], f"emu_{name}")
        function.restype = ctypes.c_char_p
        values = [_to_ctypes(a) for a in args]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        assert block[1] == block[2] == 1, "the launchers use 1-D blocks"
        error = function(*grid, block[0], argv, next(self.seed))
        if error:
            raise RuntimeError(f"{name}: {error.decode()}")


_session: Emulator | None = None


def session_emulator(tmp_path_factory) -> Emulator | None:
    """One Emulator per test session (its libraries take a while to build); None without
    g++ or the CUDA headers."""
    global _session
    include = cuda_include()
    if shutil.which("g++") is None or include is None:
        return None
    if _session is None:
        _session = Emulator(tmp_path_factory.mktemp("emulated_kernels"), include)
    return _session


def _to_ctypes(value):
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    raise TypeError(f"kernel argument of type {type(value).__name__}")

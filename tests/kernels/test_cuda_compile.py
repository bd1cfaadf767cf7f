"""Every kernels/csrc/*.cu compiles for sm_80 and sm_90, warning-free, with nvcc and NVRTC.

On a GPU the launchers compile these sources at run time with NVRTC (``cupy.RawModule``);
these checks run where no GPU exists (CI), so a syntax or type error, any compiler
warning, a register spill or local-memory use fails here instead of at the first request
on a GPU machine. Both check that every entry point the launchers can call is in the cubin.

- nvcc (``nvcc -cubin``): warnings as errors, spills and local memory as errors. Skipped
  when nvcc is not installed.
- NVRTC: the exact source and options the launcher hands CuPy (``kernel_source``,
  ``_compile_options``), compiled by libnvrtc through ctypes (NVRTC needs no GPU). NVRTC is
  stricter than nvcc in places: it refuses host functions in device code ("JIT mode"),
  which nvcc accepts, so passing nvcc alone proves nothing for the launcher. libnvrtc comes
  from the `nvidia-cuda-nvrtc` wheel (a test dependency, CUDA 13); skipped without it.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cuda import launch as cuda


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


NVCC = _find_nvcc()
SOURCES = sorted(cuda.CSRC.glob("*.cu"))
ARCHS = ["sm_80", "sm_90"]

needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found: install the CUDA toolkit to compile-check kernels/csrc"
)


def test_every_launched_file_exists():
    assert {p.name for p in SOURCES} >= set(cuda.kernel_names())


def _missing_entry_points(source: str, binary: bytes) -> list[str]:
    return [n for n in cuda.kernel_names().get(source, []) if n.encode() not in binary]


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_without_warnings(source: Path, arch: str, tmp_path: Path):
    # Compile what NVRTC is given: the source with its local headers pasted in, so that
    # warnings in header code count too (compilers keep quiet about headers).
    pasted = tmp_path / source.name
    pasted.write_text(cuda.kernel_source(source.name))
    cubin = tmp_path / f"{source.stem}.{arch}.cubin"
    command = [
        NVCC,
        "-cubin",
        f"-arch={arch}",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        # A spill or local-memory array is a performance bug in these kernels: fail on it too.
        "-Xptxas=-warn-spills,-warn-lmem-usage,-Werror",
        "-o",
        str(cubin),
        str(pasted),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "warning" not in output.lower(), output
    missing = _missing_entry_points(source.name, cubin.read_bytes())
    assert not missing, f"{source.name} lacks entry points {missing}"


# ----------------------------------------------------------------------------- NVRTC


def _find_libnvrtc() -> Path | None:
    """libnvrtc of the nvidia-cuda-nvrtc wheel (CUDA 13: nvidia/cu13/lib; CUDA 12:
    nvidia/cuda_nvrtc/lib), where it is installed."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            found = sorted(p for p in Path(base).glob(pattern) if "builtins" not in p.name)
            if found:
                return found[0]
    return None


LIBNVRTC = _find_libnvrtc()


class Nvrtc:
    """The few NVRTC calls a compile takes (nvrtc.h), through ctypes."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        return major.value, minor.value

    def compile(self, source: str, name: str, options: list[str]) -> tuple[int, str, bytes]:
        """(status, log, cubin): status 0 is success; the cubin is empty on failure."""
        program = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(
                ctypes.byref(program), source.encode(), name.encode(), 0, None, None
            )
        )
        try:
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(program, len(options), argv)
            return status, self._log(program), self._cubin(program) if status == 0 else b""
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        self._check(self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)))
        buffer = ctypes.create_string_buffer(size.value)
        self._check(self.lib.nvrtcGetProgramLog(program, buffer))
        return buffer.value.decode(errors="replace")

    def _cubin(self, program: ctypes.c_void_p) -> bytes:
        size = ctypes.c_size_t()
        self._check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        buffer = ctypes.create_string_buffer(size.value)
        self._check(self.lib.nvrtcGetCUBIN(program, buffer))
        return buffer.raw

    def _check(self, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC: {self.lib.nvrtcGetErrorString(status).decode()}")


needs_nvrtc = pytest.mark.skipif(
    LIBNVRTC is None,
    reason="libnvrtc not found: pip install nvidia-cuda-nvrtc (a test dependency of headrace)",
)


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    return Nvrtc(LIBNVRTC)


@needs_nvrtc
def test_nvrtc_is_a_cuda_13_compiler(nvrtc):
    """CUDA 13, as the GPU machines' torch and CuPy (tests/support/gpu_image/packages.txt)."""
    assert nvrtc.version()[0] == 13


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compiles_what_the_launcher_builds(nvrtc, source: Path, arch: str):
    """The launcher's source and options (kernels/cuda/launch.py), plus the architecture
    CuPy adds for the device; a warning in NVRTC's log fails too."""
    options = [*cuda._compile_options(), f"--gpu-architecture={arch}"]
    status, log, cubin = nvrtc.compile(cuda.kernel_source(source.name), source.name, options)
    assert status == 0, log
    assert "warning" not in log.lower(), log
    missing = _missing_entry_points(source.name, cubin)
    assert not missing, f"{source.name} lacks entry points {missing}"


@needs_nvrtc
def test_nvrtc_refuses_a_host_function_in_device_code(nvrtc):
    """The check above can fail: NVRTC refuses what nvcc took in paged_attention_decode.cu
    before its helper was marked __host__ __device__ (a constexpr host function used in a
    kernel's __launch_bounds__)."""
    source = (
        "constexpr int min_blocks(int g) { return g <= 4 ? 3 : 2; }\n"
        'extern "C" __global__ void __launch_bounds__(128, min_blocks(4)) k(int* x) { *x = 1; }\n'
    )
    status, log, _ = nvrtc.compile(source, "host_function.cu", ["--gpu-architecture=sm_90"])
    assert status != 0 and "host functions are not allowed in JIT mode" in log

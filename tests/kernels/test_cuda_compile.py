"""Every kernels/csrc/*.cu compiles with `nvcc -cubin` for sm_80 and sm_90, warning-free.

On a GPU the launchers compile these sources at run time with NVRTC; this
check runs where no GPU exists (CI), so a syntax or type error, any compiler
warning, a register spill or local-memory use fails here instead of at the
first request on a GPU machine. It also checks that every entry point the
launchers can call is in the cubin. Skipped when nvcc is not installed.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found: install the CUDA toolkit to compile-check kernels/csrc"
)


def test_every_launched_file_exists():
    assert {p.name for p in SOURCES} >= set(cuda.kernel_names())


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
    binary = cubin.read_bytes()
    missing = [n for n in cuda.kernel_names().get(source.name, []) if n.encode() not in binary]
    assert not missing, f"{source.name} lacks entry points {missing}"

"""Building and choosing the CPU kernels, and what the engine does when they cannot run."""

from __future__ import annotations

import pytest
import torch

from compute.core.config import DeviceConfig
from compute.device.selection import cpu_execution
from kernels.cpu import build as cpu_build
from kernels.cpu import library as cpu_library
from kernels.cpu.library import available

CPU = torch.device("cpu")
V4 = set(cpu_build.ISA_LEVELS["avx512"][1])


def test_best_isa_follows_the_cpu_flags():
    assert cpu_build.best_isa(V4 | {"avx512_vnni"}) == "avx512vnni"
    assert cpu_build.best_isa(V4) == "avx512"
    assert cpu_build.best_isa({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}) == "avx2"
    assert cpu_build.best_isa({"sse4_2", "avx"}) is None


def test_library_path_names_the_isa_and_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADRACE_KERNEL_DIR", str(tmp_path))
    paths = {isa: cpu_build.library_path(isa) for isa in cpu_build.ISA_LEVELS}
    assert all(p.parent == tmp_path and f"-{isa}-" in p.name for isa, p in paths.items())
    assert len(set(paths.values())) == len(paths)


def test_a_missing_compiler_is_a_build_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADRACE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    with pytest.raises(cpu_build.BuildError, match="no C\\+\\+ compiler"):
        cpu_build.build("avx2")
    with pytest.raises(cpu_build.BuildError, match="compiling the CPU kernels failed"):
        cpu_build.build("avx2", compiler="false")
    assert not list(tmp_path.glob("*.so")), "a failed build leaves no library behind"


@pytest.fixture
def no_kernels(monkeypatch):
    """The kernels as on a CPU without AVX2: library() raises, available() is False."""
    cpu_library._load.cache_clear()
    monkeypatch.setattr(cpu_build, "best_isa", lambda flags=None: None)
    yield
    cpu_library._load.cache_clear()


def test_without_kernels_the_engine_runs_dense_on_torch(no_kernels):
    assert not available()
    assert cpu_execution(DeviceConfig(), CPU, torch.float32) == (False, "dense")
    with pytest.raises(ValueError, match="cpu_kernels: the CPU kernels cannot be built"):
        cpu_execution(DeviceConfig(cpu_kernels="native"), CPU, torch.float32)


def test_weights_modes_need_what_they_run_on():
    if not available():
        pytest.skip("CPU kernels cannot be built here")
    assert cpu_execution(DeviceConfig(), CPU, torch.float32) == (True, "quantized")
    int8 = DeviceConfig(weights="quantized-int8")
    assert cpu_execution(int8, CPU, torch.float32) == (True, "quantized-int8")
    # bf16 on the CPU, or torch asked for: dense weights, torch ops.
    assert cpu_execution(DeviceConfig(), CPU, torch.bfloat16) == (False, "dense")
    assert cpu_execution(DeviceConfig(cpu_kernels="torch"), CPU, torch.float32) == (False, "dense")
    with pytest.raises(ValueError, match="weights: quantized weights need the CPU kernels"):
        cpu_execution(DeviceConfig(cpu_kernels="torch", weights="quantized"), CPU, torch.float32)
    with pytest.raises(ValueError, match="float32 only"):
        cpu_execution(DeviceConfig(cpu_kernels="native"), CPU, torch.bfloat16)


def test_the_engine_builds_on_one_thread_and_keeps_the_configured_count(monkeypatch):
    from compute.core.config import EngineConfig
    from compute.engine import Engine

    seen = []
    real = Engine._build
    monkeypatch.setattr(
        Engine, "_build", lambda self, *a: seen.append(torch.get_num_threads()) or real(self, *a)
    )
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(model="dummy:tiny", device=DeviceConfig(device="cpu", num_threads=2)))
        assert seen == [1], "built on one thread: the constructing thread gets no OpenMP team"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

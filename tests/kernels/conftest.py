"""Fixtures of the CUDA kernels' tests (test_kernels_gpu.py, test_kernels_gpu_window.py):
the host emulation of the kernels' source, standing in for a GPU."""

from __future__ import annotations

import pytest

from kernels.cuda import launch as cuda
from tests.support.cuda_host.emulator import Emulator, session_emulator


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Emulator:
    emulator = session_emulator(tmp_path_factory)
    if emulator is None:
        pytest.skip("the CPU emulation needs g++ and the CUDA headers (cuda_fp16.h)")
    return emulator


@pytest.fixture
def emulated(emulator: Emulator, monkeypatch) -> str:
    """Routes kernels.cuda's launches to the CPU emulation; returns the device to use."""
    monkeypatch.setattr(cuda, "_launch", emulator.launch)
    monkeypatch.setattr(cuda, "_require_gpu", lambda t, name: None)
    return "cpu"


@pytest.fixture(params=cuda.DECODE_VARIANTS)
def decode_variant(request, monkeypatch) -> str:
    """Runs a test with each decode kernel (kernels.cuda.launch.DECODE_VARIANTS)."""
    monkeypatch.setattr(cuda, "decode_variant", request.param)
    return request.param

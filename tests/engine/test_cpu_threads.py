"""compute/device/threads.py: the default thread count follows the affinity mask and the
cgroup CPU quota (v1 and v2, nested), on fake cgroup trees; the engine applies it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.device import threads as cpu_threads
from compute.engine import Engine


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2(tmp: Path, levels: dict[str, str], own: str = "/kubepods/pod1/c1") -> tuple[Path, Path]:
    """A cgroup v2 tree: {relative dir: cpu.max}; the process in ``own``."""
    root = tmp / "cgroup"
    for rel, value in levels.items():
        _write(root / rel / "cpu.max", value)
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def test_v2_quota_of_the_own_cgroup(tmp_path) -> None:
    root, proc = _v2(tmp_path, {"kubepods/pod1/c1": "250000 100000"})
    assert cpu_threads.cgroup_cpu_limit(root, proc) == 2.5


def test_v2_tightest_ancestor_wins(tmp_path) -> None:
    levels = {"kubepods": "max 100000", "kubepods/pod1": "150000 100000", "": "max 100000"}
    levels["kubepods/pod1/c1"] = "400000 100000"
    root, proc = _v2(tmp_path, levels)
    assert cpu_threads.cgroup_cpu_limit(root, proc) == 1.5


def test_v2_unlimited_and_container_namespace(tmp_path) -> None:
    root, proc = _v2(tmp_path, {"": "max 100000"}, own="/")
    assert cpu_threads.cgroup_cpu_limit(root, proc) is None
    _write(root / "cpu.max", "100000 100000")  # a container's own view: its cgroup is "/"
    assert cpu_threads.cgroup_cpu_limit(root, proc) == 1.0


def test_v1_cfs_quota(tmp_path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000")
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_threads.cgroup_cpu_limit(root, proc) == 3.0


def test_no_cgroup_files_means_no_limit(tmp_path) -> None:
    assert cpu_threads.cgroup_cpu_limit(tmp_path / "none", tmp_path / "missing") is None
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/x\n")
    _write(tmp_path / "cgroup" / "x" / "cpu.max", "garbage")
    assert cpu_threads.cgroup_cpu_limit(tmp_path / "cgroup", proc) is None


def test_available_cpus_rounds_the_quota_down_and_keeps_one(tmp_path) -> None:
    affinity = len(os.sched_getaffinity(0))
    root, proc = _v2(tmp_path, {"kubepods/pod1/c1": "50000 100000"})  # half a CPU
    assert cpu_threads.available_cpus(root, proc) == 1
    _write(root / "kubepods/pod1/c1/cpu.max", f"{(affinity + 3) * 100000} 100000")
    assert cpu_threads.available_cpus(root, proc) == affinity  # the mask is tighter
    _write(root / "kubepods/pod1/c1/cpu.max", "190000 100000")
    assert cpu_threads.available_cpus(root, proc) == min(affinity, 1)


def test_default_threads_never_exceeds_torch_default(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda *a: 64)
    assert cpu_threads.default_threads(4) == 4
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda *a: 1)
    assert cpu_threads.default_threads(4) == 1


@pytest.mark.parametrize(("flag", "expected"), [(None, 1), (3, 3)])
def test_engine_applies_the_default_or_the_flag(monkeypatch, flag, expected) -> None:
    import compute.device.selection as engine_module

    before = torch.get_num_threads()
    monkeypatch.setattr(engine_module, "default_threads", lambda torch_default: 1)
    try:
        torch.set_num_threads(2)  # the default is patched to 1, the flag wins over it
        config = EngineConfig(
            model="dummy:tiny",
            device=DeviceConfig(device="cpu", num_threads=flag),
            cache=CacheConfig(num_blocks=16),
        )
        Engine(config)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_engine_warns_when_the_flag_exceeds_the_cpus(monkeypatch, capsys) -> None:
    import compute.device.selection as engine_module

    before = torch.get_num_threads()
    monkeypatch.setattr(engine_module, "available_cpus", lambda: 1)
    try:
        config = EngineConfig(
            model="dummy:tiny",
            device=DeviceConfig(device="cpu", num_threads=2),
            cache=CacheConfig(num_blocks=16),
        )
        Engine(config)
    finally:
        torch.set_num_threads(before)
    assert "more CPU threads than CPUs this process may use" in capsys.readouterr().out

"""The GPU KV cache sized from --gpu-memory-utilization (compute/runner/kv_sizing.py), on the
CPU with faked device memory figures: the arithmetic, the refusal naming both figures when
one max_model_len sequence does not fit, the flag, and the memory log line's GPU figures."""

from __future__ import annotations

import types

import pytest
import torch
from structlog.testing import capture_logs

from compute.core.config import CacheConfig, EngineConfig, SchedulerConfig
from compute.device import memory_report
from compute.loaders.dummy import SHAPES
from compute.runner import kv_sizing
from compute.runner.model_runner import default_num_blocks, kv_bytes_per_block
from services.cli import cli, cli_flags

GIB = 1024**3
CUDA = torch.device("cuda")
MODEL = SHAPES["smollm2-135m"]


def _config(utilization: float = 0.9, **cache) -> EngineConfig:
    return EngineConfig(
        model="dummy:smollm2-135m",
        cache=CacheConfig(block_size=16, gpu_memory_utilization=utilization, **cache),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )


@pytest.fixture
def device(monkeypatch):
    """Fakes torch.cuda.mem_get_info for the sizing: set .free and .total (bytes)."""
    fake = types.SimpleNamespace(free=0, total=0, asked=0)

    def memory(dev):
        assert dev.type == "cuda"
        fake.asked += 1
        return fake.free, fake.total

    monkeypatch.setattr(kv_sizing, "device_memory", memory)
    return fake


def test_the_cache_gets_what_the_utilization_leaves(device) -> None:
    """80 GiB card, 1.5 GiB in use after the weights: 0.9 x 80 - 1.5 - the reserve."""
    device.total, device.free = 80 * GIB, int(78.5 * GIB)
    config = _config()
    block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    reserve = kv_sizing.activation_reserve(config, MODEL, torch.bfloat16)
    with capture_logs() as logs:
        blocks = default_num_blocks(config, MODEL, CUDA, torch.bfloat16, 8192)
    assert blocks == (int(0.9 * 80 * GIB) - int(1.5 * GIB) - reserve) // block
    assert blocks * block > 60 * GIB  # not the 2 GiB of before
    assert GIB < reserve < 4 * GIB  # SmolLM2 at 2048 tokens a step: the fixed GiB and a bit
    [line] = [entry for entry in logs if entry["event"] == "kv cache sized"]
    assert line["num_blocks"] == blocks and line["tokens"] == 16 * blocks
    assert line["gpu_memory_utilization"] == 0.9 and line["in_use_mib"] == 1536


def test_the_utilization_scales_the_cache(device) -> None:
    device.total, device.free = 80 * GIB, 79 * GIB
    full = default_num_blocks(_config(0.9), MODEL, CUDA, torch.bfloat16, 8192)
    half = default_num_blocks(_config(0.5), MODEL, CUDA, torch.bfloat16, 8192)
    block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    assert full - half == pytest.approx(0.4 * 80 * GIB / block, abs=2)


def test_memory_other_processes_hold_is_not_taken(device) -> None:
    """In use = total - free: another process's 40 GiB come off the budget too."""
    device.total = 80 * GIB
    device.free = 79 * GIB
    alone = default_num_blocks(_config(), MODEL, CUDA, torch.bfloat16, 8192)
    device.free = 39 * GIB
    shared = default_num_blocks(_config(), MODEL, CUDA, torch.bfloat16, 8192)
    block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    assert alone - shared == pytest.approx(40 * GIB / block, abs=1)


def test_nothing_fitting_is_refused_with_both_figures(device) -> None:
    """A 16 GiB card with 13.5 GiB in use: 0.9 x 16 - 13.5 - the reserve leaves nothing; the
    error names the setting, what the cache would hold and what one sequence needs."""
    device.total, device.free = 16 * GIB, int(2.5 * GIB)
    with pytest.raises(ValueError) as error:
        default_num_blocks(_config(), MODEL, CUDA, torch.bfloat16, 8192)
    message = str(error.value)
    assert message.startswith("gpu_memory_utilization: 0.9 of the GPU's 16.0 GiB leaves ")
    assert "0.00 GiB for the KV cache (0 tokens) after 13.50 GiB in use" in message
    needed = 8192 // 16 * kv_bytes_per_block(MODEL, 16, torch.bfloat16) / GIB
    assert f"one sequence of max_model_len 8192 tokens needs {needed:.2f} GiB" in message
    assert "--gpu-memory-utilization" in message


def test_a_cache_just_short_of_one_sequence_is_refused(device) -> None:
    config = _config()
    block = kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    reserve = kv_sizing.activation_reserve(config, MODEL, torch.bfloat16)
    device.total = 100 * GIB
    room = int(0.9 * device.total) - reserve
    device.free = device.total - (room - 511 * block)  # 511 blocks left, 512 needed
    with pytest.raises(ValueError, match=r"\(8176 tokens\)"):
        default_num_blocks(config, MODEL, CUDA, torch.bfloat16, 8192)
    device.free += block
    assert default_num_blocks(config, MODEL, CUDA, torch.bfloat16, 8192) == 512


def test_explicit_sizes_do_not_ask_the_device(device) -> None:
    config = _config(memory_gib=2.0)
    blocks = default_num_blocks(config, MODEL, CUDA, torch.bfloat16, 8192)
    assert blocks == 2 * GIB // kv_bytes_per_block(MODEL, 16, torch.bfloat16)
    assert device.asked == 0


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_the_utilization_must_be_a_fraction(value) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=value)
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> cli_flags.Configs:
    return cli_flags.build_configs(cli.build_parser(environ or {}).parse_args(argv))


def test_the_flag_and_its_env_twin() -> None:
    assert _parse(["serve"]).engine.cache.gpu_memory_utilization == 0.9
    argv = ["serve", "--gpu-memory-utilization", "0.75"]
    assert _parse(argv).engine.cache.gpu_memory_utilization == 0.75
    environ = {"HEADRACE_GPU_MEMORY_UTILIZATION": "0.5"}
    assert _parse(["serve"], environ).engine.cache.gpu_memory_utilization == 0.5
    assert "--gpu-memory-utilization" in cli_flags.OFFLINE_FLAGS
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _parse(["serve", "--gpu-memory-utilization", "1.5"])


def test_the_memory_line_has_the_gpu_figures(monkeypatch) -> None:
    monkeypatch.setattr(memory_report, "gpu_memory", lambda dev: (8 * GIB, 80 * GIB))
    runner = types.SimpleNamespace(device=CUDA, kv_caches=[torch.zeros(4)])
    with capture_logs() as logs:
        report = memory_report.log_memory(torch.nn.Linear(2, 2), runner)
    assert report["gpu"] == {"total": 80 * GIB, "free": 8 * GIB, "in_use_fraction": 0.9}
    [line] = [entry for entry in logs if entry["event"] == "memory"]
    assert line["gpu_mib"] == {"total": 80 * 1024, "free": 8 * 1024, "in_use_fraction": 0.9}


def test_the_memory_line_on_the_cpu_has_no_gpu_figures() -> None:
    runner = types.SimpleNamespace(device=torch.device("cpu"), kv_caches=[torch.zeros(4)])
    with capture_logs() as logs:
        report = memory_report.log_memory(torch.nn.Linear(2, 2), runner)
    assert report["gpu"] is None
    assert "gpu_mib" not in next(e for e in logs if e["event"] == "memory")

"""kernels.ops.check_backend and the engine's start-up check, on the CPU with fakes.

`--device cuda` must fail when the engine starts (not at its first step) for
what the CUDA kernels cannot serve, and must never quietly run the torch
reference instead of the kernels.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from structlog.testing import capture_logs

from compute.core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from compute.engine import Engine
from compute.loaders.base import LoadedModel
from compute.loaders.dummy import dummy_weights, load_dummy
from kernels import ops
from kernels.cuda import launch as cuda
from tests.support.cuda_host.fake_cupy import FakeCupy

GPU = torch.device("cuda", 0)
SMOL = dict(head_dim=64, num_heads=9, num_kv_heads=3)


@pytest.fixture
def fake_cupy(monkeypatch) -> FakeCupy:
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(cuda, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cuda, "_kernels", {})
    return fake


def test_cpu_runs_the_reference_and_says_so():
    with capture_logs() as logs:
        backend = ops.check_backend(torch.device("cpu"), torch.float32, **SMOL, block_size=64)
    assert backend == ops.REFERENCE
    (line,) = [e for e in logs if e["event"] == "attention backend"]
    assert line["backend"] == "torch-reference" and line["component"] == "kernels.ops"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_warms_up_every_kernel_and_says_so(fake_cupy, dtype, block_size):
    with capture_logs() as logs:
        assert ops.check_backend(GPU, dtype, **SMOL, block_size=block_size) == ops.CUDA
    assert len(fake_cupy.compiles) == 3  # every .cu, before the first step
    suffix = cuda.ATTENTION_DTYPES[dtype]
    loaded = {name for _, _, _, name in cuda._kernels if name}
    assert f"paged_attention_decode_{suffix}_d64_b{block_size}" in loaded
    assert f"paged_attention_decode_reduce_{suffix}_d64" in loaded
    assert f"paged_attention_prefill_{suffix}_d64" in loaded
    assert {"reshape_and_cache_w16", "reshape_and_cache_w4", "reshape_and_cache_w2"} <= loaded
    (line,) = [e for e in logs if e["event"] == "attention backend"]
    assert line["backend"] == "cuda-cupy" and line["kernels_loaded"] == 6
    assert line["block_size"] == block_size and line["head_dim"] == 64


BAD = {
    "fp32": (dict(dtype=torch.float32), ValueError, r"dtype: .*float16, bfloat16.*--dtype"),
    "block 64": (dict(block_size=64), ValueError, r"block_size: .*16 or 32.*--block-size"),
    "block 8": (dict(block_size=8), ValueError, "block_size"),
    "head dim 80": (dict(head_dim=80), ValueError, "head dim 64 or 128, this model has 80"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_cuda_refuses_what_the_kernels_lack(fake_cupy, case):
    change, error, message = BAD[case]
    args = dict(dtype=torch.float16, block_size=16, **SMOL) | change
    with pytest.raises(error, match=message):
        ops.check_backend(GPU, **args)
    assert fake_cupy.compiles == []


def test_cuda_without_cupy_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(RuntimeError, match="CuPy is not installed.*make setup-gpu"):
        ops.check_backend(GPU, torch.bfloat16, **SMOL, block_size=16)


def test_cuda_tensors_never_fall_back_to_the_reference(monkeypatch):
    """A CUDA tensor without CuPy is an error at the call, not a quiet torch run."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    called = []
    monkeypatch.setattr(ops.reference, "paged_attention", lambda *a: called.append(a))
    monkeypatch.setattr(ops.reference, "reshape_and_cache", lambda *a: called.append(a))
    cuda_tensor = types.SimpleNamespace(is_cuda=True)
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        ops.paged_attention(cuda_tensor, None, None, None, 1.0)
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        ops.reshape_and_cache(cuda_tensor, None, None, None, None)
    assert called == []


@pytest.mark.parametrize(
    "dtype,block_size,message",
    [("float32", 16, "dtype"), ("float16", 64, "block_size"), ("bfloat16", 16, "head dim")],
)
def test_engine_start_fails_before_the_first_step(
    monkeypatch, fake_cupy, dtype, block_size, message
):
    """--device cuda with settings the kernels cannot serve: Engine() raises, naming them.

    resolve_device is faked (no GPU here); the weights are a CPU dummy model (head dim 16,
    which the kernels lack: the third case)."""
    torch_dtype = getattr(torch, dtype)
    monkeypatch.setattr("compute.engine.resolve_device", lambda d, t: (GPU, torch_dtype))
    config = EngineConfig(
        device=DeviceConfig(device="cuda", dtype=dtype), cache=CacheConfig(block_size=block_size)
    )
    loaded = load_dummy("tiny", torch_dtype, "cpu")
    with pytest.raises(ValueError, match=message):
        Engine(config, loaded=loaded)
    assert fake_cupy.compiles == []


class _Started(Exception):
    """Raised where the engine, past every model check, would allocate its KV cache."""


@pytest.mark.parametrize("max_model_len", [None, 400])
def test_engine_accepts_windows_and_softcaps_on_cuda(monkeypatch, fake_cupy, max_model_len):
    """The CUDA kernels mask windows and cap scores: a Gemma 2-like model (alternating
    sliding layers, attention soft-cap) starts on --device cuda with its whole context."""
    monkeypatch.setattr("compute.engine.resolve_device", lambda d, t: (GPU, torch.float16))

    def started(engine, config, model):
        raise _Started(engine)

    monkeypatch.setattr(Engine, "_build_cache", started)
    config = ModelConfig(
        name="gemma2-like", architecture="gemma2", vocab_size=300, hidden_size=128,
        intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
        max_position_embeddings=512, sliding_window=32, layer_types=("sliding", "full"),
        hidden_act="gelu_tanh", sandwich_norms=True, attn_logit_softcap=20.0,
        final_logit_softcap=15.0,
    )  # fmt: skip
    loaded = LoadedModel(config, dummy_weights(config, torch.float16, "cpu", 0), None, "dummy")
    engine_config = EngineConfig(
        device=DeviceConfig(device="cuda", dtype="float16"),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )
    with pytest.raises(_Started) as started_engine:
        Engine(engine_config, loaded=loaded)
    assert started_engine.value.args[0].max_model_len == (max_model_len or 512)
    assert len(fake_cupy.compiles) == 3  # the kernels were warmed up for it

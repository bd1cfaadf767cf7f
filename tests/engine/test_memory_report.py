"""compute/device/memory_report.py: tensors found wherever they sit, each storage counted once, and
the engine's breakdown matching the model's and the KV cache's own tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.device.memory_report import memory_breakdown, tensor_bytes
from compute.engine import Engine


@dataclass
class _Layer:
    weight: torch.Tensor
    packed: tuple[torch.Tensor, ...]


class _Slotted:
    __slots__ = ("scales",)

    def __init__(self, scales: torch.Tensor) -> None:
        self.scales = scales


def test_each_storage_counts_once_wherever_it_is_reachable() -> None:
    big = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    tied = big  # the same tensor under two owners
    view = big[10:20]  # a view: the same storage
    quant = torch.zeros(300, dtype=torch.uint8)  # 300 bytes, as a quantized weight might be
    scales = torch.zeros(25, dtype=torch.float16)  # 50 bytes, inside a __slots__ object
    root = {
        "layers": [_Layer(big, (view, quant)), _Layer(tied, ())],
        "extra": _Slotted(scales),
        "names": ["a", "b"],
        "cycle": None,
    }
    root["cycle"] = root
    assert tensor_bytes(root) == {"cpu": 4000 + 300 + 50}


def test_exclude_and_skip_leave_counted_tensors_out() -> None:
    shared = torch.zeros(100, dtype=torch.float32)
    model = [shared]
    runner = {"model": model, "cache": [torch.zeros(10, dtype=torch.int64)], "alias": shared}
    counted: set = set()
    assert tensor_bytes(model, exclude=counted) == {"cpu": 400}
    # The runner's own reference to the model is skipped; its alias of a model tensor is
    # already counted.
    assert tensor_bytes(runner, skip=(model,), exclude=counted) == {"cpu": 80}


def test_engine_breakdown_matches_model_and_kv_tensors() -> None:
    engine = Engine(
        EngineConfig(
            model="dummy:tiny",
            cache=CacheConfig(block_size=16, num_blocks=64),
            device=DeviceConfig(device="cpu"),
        )
    )
    report = memory_breakdown(engine.runner.model, engine.runner)
    kv = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
    assert report["kv_cache_bytes"] == {"cpu": kv}
    cfg = engine.model_config
    # 64 blocks x 16 slots x kv heads x head dim, keys and values, every layer, fp32.
    assert kv == 2 * cfg.num_layers * 64 * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    embed = engine.runner.model.embed_tokens
    assert report["model_bytes"]["cpu"] > embed.nbytes  # the layers and copies come on top
    assert engine.memory["kv_cache_bytes"] == report["kv_cache_bytes"]
    assert report["rss_bytes"] is None or report["rss_bytes"] > 0

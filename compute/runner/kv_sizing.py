"""How many KV blocks a GPU holds: what --gpu-memory-utilization leaves after the rest.

As vLLM's ``--gpu-memory-utilization``: the engine may fill that fraction of the device's
memory in all. Measured once the weights are on the device (``torch.cuda.mem_get_info``,
so the CUDA context, torch's pool and other processes count too), less an estimate of
what is still to come, the step's activations and the CUDA graphs (captured after the
cache, as they point into it), the rest is KV cache:

    kv_bytes = utilization x total - in use now - reserve

``reserve`` = the activations of a step of max_num_batched_tokens tokens (hidden states,
q/k/v, the MLP's gate and up, the masks of a windowed prefill chunk), the sampler's fp32
rows over the vocabulary for max_num_seqs sequences, and GPU_FIXED_RESERVE (cuBLAS
workspaces, the graphs' pool, allocator slack). An estimate, not a profile: the memory log
line (compute/device/memory_report.py) shows what is free once the graphs are in.

A cache that cannot hold one sequence of max_model_len tokens is refused at start-up,
with both numbers, as vLLM refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compute.core.config import EngineConfig, ModelConfig
from kernels.log import get_logger

log = get_logger(__name__)
GIB = 1024**3
MIB = 1024**2
GPU_FIXED_RESERVE = GIB


@dataclass(frozen=True)
class GpuKvBudget:
    """The figures of one sizing, in bytes (logged, and named in a refusal)."""

    utilization: float
    total: int  # the device's memory
    in_use: int  # total - free when the cache is sized (weights, context, other processes)
    reserve: int  # activations and graphs still to come

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.utilization * self.total) - self.in_use - self.reserve)


def activation_reserve(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a step's temporaries may take beyond the weights and the cache (an upper
    estimate; see the module docstring)."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = config.scheduler.max_num_batched_tokens
    per_token = 4 * model.hidden_size + model.q_size + 2 * model.kv_size
    per_token += 3 * model.intermediate_size
    # A windowed or chunked prefill's mask: rows of every query head group over the keys.
    longest = config.scheduler.max_model_len or model.max_position_embeddings
    group = model.num_heads // model.num_kv_heads
    mask = min(tokens, longest) * group * longest * (1 + elem)
    # The sampler: logits, probabilities, sorted values and their int64 indices, fp32.
    sampler = config.scheduler.max_num_seqs * model.vocab_size * 4 * 5
    return tokens * per_token * elem + mask + sampler + GPU_FIXED_RESERVE


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device (tests fake it)."""
    return torch.cuda.mem_get_info(device)


def gpu_num_blocks(
    config: EngineConfig,
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    block_bytes: int,
    max_model_len: int,
) -> int:
    """KV blocks for --gpu-memory-utilization; ValueError naming the flag, what the cache
    would hold and what one sequence needs, when it cannot hold one of max_model_len."""
    free, total = device_memory(device)
    budget = GpuKvBudget(
        utilization=config.cache.gpu_memory_utilization,
        total=total,
        in_use=total - free,
        reserve=activation_reserve(config, model, dtype),
    )
    blocks = budget.kv_bytes // block_bytes
    block_size = config.cache.block_size
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"gpu_memory_utilization: {budget.utilization} of the GPU's "
            f"{total / GIB:.1f} GiB leaves {budget.kv_bytes / GIB:.2f} GiB for the KV cache "
            f"({blocks * block_size} tokens) after {budget.in_use / GIB:.2f} GiB in use and "
            f"{budget.reserve / GIB:.2f} GiB kept for activations and graphs; one sequence "
            f"of max_model_len {max_model_len} tokens needs {needed * block_bytes / GIB:.2f} "
            f"GiB. Raise --gpu-memory-utilization, lower --max-model-len or "
            f"--max-num-batched-tokens, or set --num-blocks / --kv-cache-memory-gib"
        )
    log.info(
        "kv cache sized",
        gpu_memory_utilization=budget.utilization,
        total_mib=round(total / MIB),
        in_use_mib=round(budget.in_use / MIB),
        reserve_mib=round(budget.reserve / MIB),
        kv_cache_mib=round(blocks * block_bytes / MIB),
        num_blocks=blocks,
        tokens=blocks * block_size,
    )
    return blocks

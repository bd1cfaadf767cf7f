"""Runs one scheduled step on the model: build the flat batch, forward, sample.

Owns the model, the paged KV cache tensors (and the host copy used by
preemption_mode=swap) and the sampler. Returns plain lists to the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from compute.core.config import (
    CPU_KV_TOKENS_PER_SEQ,
    GPU_KV_MEMORY_GIB,
    CacheConfig,
    EngineConfig,
    ModelConfig,
)
from compute.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from compute.core.sequence import Sequence
from compute.fault_injection import FaultInjector
from compute.model import LlamaModel
from compute.sampler import Sampler
from kernels.metadata import AttentionMetadata

GIB = 1024**3
# What a client sees when its sampled id was out of range (the details go to the log).
BAD_TOKEN_MESSAGE = "the sampler produced an invalid token id for this request"


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def blocks_for_memory(cfg: ModelConfig, cache: CacheConfig, gib: float, dtype) -> int:
    return int(gib * GIB) // kv_bytes_per_block(cfg, cache.block_size, dtype)


def default_num_blocks(
    config: EngineConfig, model: ModelConfig, device: torch.device, dtype, max_model_len: int
) -> int:
    """KV blocks when --num-blocks is unset: --kv-cache-memory-gib when given, else 2 GiB on a
    GPU and, on the CPU, max_num_seqs * CPU_KV_TOKENS_PER_SEQ tokens (>= one max_model_len)."""
    cache = config.cache
    if cache.memory_gib is not None:
        return blocks_for_memory(model, cache, cache.memory_gib, dtype)
    if device.type != "cpu":
        return blocks_for_memory(model, cache, GPU_KV_MEMORY_GIB, dtype)
    tokens = max(config.scheduler.max_num_seqs * CPU_KV_TOKENS_PER_SEQ, max_model_len)
    return -(-tokens // cache.block_size)


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]: flat index of each sampling sequence's last token
    sampling_seqs: list[Sequence]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_cache(num_blocks, model.device)
        # Host blocks for swap preemption; pinned when the model is on a GPU.
        self.host_caches = self._allocate_cache(num_host_blocks, "cpu") if num_host_blocks else []
        self.sampler = Sampler(model.config.vocab_size, seed)
        self._faults: FaultInjector | None = None  # test-only (compute/fault_injection.py)

    @property
    def faults(self) -> FaultInjector | None:
        return self._faults

    @faults.setter
    def faults(self, injector: FaultInjector | None) -> None:
        self._faults = injector
        self.sampler.faults = injector
        self.forward_end = 0.0  # perf_counter() after the latest forward, for StepTiming

    def _allocate_cache(self, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model.config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = str(device) == "cpu" and self.device.type == "cuda"
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
                torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin),
            )
            for _ in range(cfg.num_layers)
        ]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.swap(sched)
        return self.run(sched.scheduled)

    def swap(self, sched: SchedulerOutput) -> None:
        """The step's block copies; done once per step, before any forward."""
        self._swap(sched.blocks_to_swap_out, to_host=True)
        self._swap(sched.blocks_to_swap_in, to_host=False)

    def run(self, scheduled: list[ScheduledSequence]) -> ModelRunnerOutput:
        """Forward + sample for ``scheduled`` (any subset of a step: the engine retries
        subsets to isolate a fault; rewriting a position's K/V gives the same values)."""
        self.sampler.commit()
        if not scheduled:
            return ModelRunnerOutput([], [], [])
        batch = self.prepare(scheduled)
        if self._faults is not None:
            self._faults.check_forward([item.seq for item in scheduled])
        hidden = self.model.forward(batch.token_ids, batch.positions, self.kv_caches, batch.meta)
        self.forward_end = time.perf_counter()  # read by Engine.step for StepTiming
        if not batch.sampling_seqs:
            return ModelRunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        token_ids, logprobs = self.sampler.sample(logits, batch.sampling_seqs)
        return self._checked(batch.sampling_seqs, token_ids, logprobs)

    def _checked(self, seqs: list[Sequence], token_ids: list[int], logprobs) -> ModelRunnerOutput:
        """The output, with rows whose id is outside [0, vocab) moved to ``faulty``: such an
        id must never reach the embedding lookup (it would fail the whole next step)."""
        vocab = self.sampler.vocab_size
        out = ModelRunnerOutput([], [], [])
        for seq, token, logprob in zip(seqs, token_ids, logprobs, strict=True):
            if 0 <= token < vocab:
                out.request_ids.append(seq.request_id)
                out.sampled_token_ids.append(token)
                out.logprobs.append(logprob)
            else:
                out.faulty[seq.request_id] = BAD_TOKEN_MESSAGE
        return out

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables, sample_rows, sampling = [], [], [], [], []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(seq.token_ids_slice(start, end))
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(seq.block_ids)
            if item.samples:
                sample_rows.append(len(token_ids) - 1)
                sampling.append(seq)
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, self.block_size, device=self.device
        )
        return StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampling_seqs=sampling,
        )

    def _swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy whole blocks between device and host caches, (src, dst) by direction."""
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for (dk, dv), (hk, hv) in zip(self.kv_caches, self.host_caches, strict=True):
            if to_host:
                hk[dst_ids] = dk[src_ids.to(dk.device)].to("cpu")
                hv[dst_ids] = dv[src_ids.to(dv.device)].to("cpu")
            else:
                dk[dst_ids.to(dk.device)] = hk[src_ids].to(dk.device)
                dv[dst_ids.to(dv.device)] = hv[src_ids].to(dv.device)

"""Runs one scheduled step on the model: build the flat batch, forward, sample.

Owns the model, the paged KV cache tensors (and the host copy used by
preemption_mode=swap) and the sampler. Returns plain lists to the engine.

``launch`` queues a step's work and returns at once with a ``StepResult``; its ``resolve``
waits for the sampled ids to reach the host (on a GPU they are copied into pinned memory
behind the step, with an event; on the CPU the work is done when launch returns). The
engine may launch the next step before resolving this one (asynchronous output): a
sequence's input token is then a PLACEHOLDER, and the runner feeds the id sampled for it
by the previous step straight from the device (``begin_step`` marks the boundary).

Speculative decoding: a scheduled sequence with a draft puts its draft tokens after its
own in the flat batch (a multi-token query, as a prefill chunk), and logits are taken at
every one of those 1 + K positions; ``Sampler.sample_drafts`` keeps what it accepts, and
the step's ids are read on the host at once (speculation runs with synchronous output).
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
from compute.models.decoder import DecoderModel
from compute.runner.cuda_graphs import DecodeGraphs
from compute.runner.step_batch import StepBatch
from compute.sampling.fault_hook import FaultHook
from compute.sampling.sampler import LogprobRows, Sampler
from kernels.metadata import AttentionMetadata
from kernels.reference import kv_row_width
from kernels.transfer import device_tensor

GIB = 1024**3
# What a client sees when its sampled id was out of range (the details go to the log).
BAD_TOKEN_MESSAGE = "the sampler produced an invalid token id for this request"


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    width = kv_row_width(cfg.head_dim, dtype)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * width * elem


def kv_cache_dtype(
    cache: CacheConfig,
    device: torch.device,
    dtype: torch.dtype,
    weights: str,
    head_dim: int | None = None,
) -> torch.dtype:
    """The KV cache's element type: --kv-cache-dtype, or for "auto" the model dtype (fp32 on
    the CPU: the exact weight modes stay exact), float16 with quantized-int8 weights.
    ValueError naming the setting when the CUDA kernels cannot read it (they read caches
    of the model dtype only), or when int8 rows cannot carry their scale (``head_dim``, when
    given, not a multiple of 16)."""
    name = cache.kv_cache_dtype
    if name == "auto":
        return torch.float16 if weights == "quantized-int8" else dtype
    if name == "int8" and head_dim is not None and head_dim % 16:
        raise ValueError(
            f"kv_cache_dtype: an int8 KV cache needs a head_dim that is a multiple of 16 "
            f"(each row carries its scale in 16 of its codes); this model's is {head_dim}"
        )
    wanted = getattr(torch, name)
    if device.type == "cuda" and wanted != dtype:
        model = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype: the CUDA attention kernels read a KV cache of the model dtype "
            f"only ({model}), got --kv-cache-dtype {name} (use auto or --dtype {name})"
        )
    return wanted


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


class StepResult:
    """A launched step's sampled ids and logprobs, on their way to the host.

    ``faulty``: requests the launch itself failed on (fault isolation); ``resolve`` adds
    those whose sampled id was out of range. Runs of parts of one step merge into one.
    """

    def __init__(self, vocab_size: int, faulty: dict[str, str] | None = None) -> None:
        self.vocab_size = vocab_size
        self.faulty: dict[str, str] = faulty or {}
        self._parts: list[tuple[list[Sequence], torch.Tensor, LogprobRows, object]] = []
        # Verified drafts (speculative decoding), already on the host: per sequence, the
        # ids it emits and their logprobs.
        self._host_parts: list[tuple[list[Sequence], list[list[int]], list[list]]] = []

    def add(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: LogprobRows) -> None:
        """One run's rows; device tensors are copied behind the work that makes them."""
        event = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            tokens = host.copy_(tokens, non_blocking=True)
            logprobs = logprobs.to_host(non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._parts.append((seqs, tokens, logprobs, event))

    def add_emitted(
        self, seqs: list[Sequence], token_ids: list[list[int]], logprobs: list[list]
    ) -> None:
        """One run's verified drafts: one or more emitted ids per sequence, on the host."""
        self._host_parts.append((seqs, token_ids, logprobs))

    def merge(self, other: StepResult) -> None:
        self._parts.extend(other._parts)
        self._host_parts.extend(other._host_parts)
        self.faulty.update(other.faulty)

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the ids (this step's copies only, not later steps) and check them."""
        out = ModelRunnerOutput([], [], [])
        for seqs, tokens, logprobs, event in self._parts:
            if event is not None:
                event.synchronize()
            ids, records = tokens.tolist(), logprobs.records()
            out.merge(_checked(seqs, ids, records, self.vocab_size))
        for seqs, emitted, emitted_logprobs in self._host_parts:
            for seq, ids, records in zip(seqs, emitted, emitted_logprobs, strict=True):
                part = _checked([seq] * len(ids), ids, records, self.vocab_size)
                if part.faulty:
                    out.faulty.update(part.faulty)
                    continue
                out.request_ids.append(seq.request_id)
                out.sampled_token_ids.append(ids[0])
                out.logprobs.append(records[0])
                out.more_tokens[seq.request_id] = list(zip(ids[1:], records[1:], strict=True))
        return out


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        cache: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.kv_dtype = kv_dtype or model.dtype  # the caches' (kv_cache_dtype)
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_cache(num_blocks, model.device)
        # Host blocks for swap preemption; pinned when the model is on a GPU.
        self.host_caches = self._allocate_cache(num_host_blocks, "cpu") if num_host_blocks else []
        self.sampler = Sampler(
            model.config.vocab_size,
            seed,
            tuple(model.config.eos_token_ids),
            native_argmax=model.native,
        )
        self._faults: FaultHook | None = None  # tests only (compute/sampling/fault_hook.py)
        # request id -> (device ids, row) of the tokens sampled by the current and the
        # previous step: where a PLACEHOLDER input's id is read from.
        self._step_ids: dict[str, tuple[torch.Tensor, int]] = {}
        self._prev_ids: dict[str, tuple[torch.Tensor, int]] = {}
        # (before, after): called around every launch (bench/gpu/step_gap.py records CUDA
        # events there, to see the device's idle time between steps); None: no calls.
        self.launch_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps (the engine's)

    @property
    def faults(self) -> FaultHook | None:
        return self._faults

    @faults.setter
    def faults(self, injector: FaultHook | None) -> None:
        self._faults = injector
        self.sampler.faults = injector
        self.forward_end = 0.0  # perf_counter() after the latest forward, for StepTiming

    def _allocate_cache(self, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model.config
        width = kv_row_width(cfg.head_dim, self.kv_dtype)
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, width)
        pin = str(device) == "cpu" and self.device.type == "cuda"
        return [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=device, pin_memory=pin),
                torch.zeros(shape, dtype=self.kv_dtype, device=device, pin_memory=pin),
            )
            for _ in range(cfg.num_layers)
        ]

    def swap(self, sched: SchedulerOutput) -> None:
        """The step's block copies; done once per step, before any forward. Forks' copies
        come last: a block a fork copies may have just been swapped in."""
        self._swap(sched.blocks_to_swap_out, to_host=True)
        self._swap(sched.blocks_to_swap_in, to_host=False)
        self._copy(sched.blocks_to_copy)

    def begin_step(self) -> None:
        """A new step starts: the ids sampled so far are the previous step's."""
        self._prev_ids, self._step_ids = self._step_ids, {}

    def launch(self, scheduled: list[ScheduledSequence]) -> StepResult:
        """Forward + sample for ``scheduled`` (any subset of a step: the engine retries
        subsets to isolate a fault; rewriting a position's K/V gives the same values)."""
        if self.launch_hooks is None:
            return self._launch(scheduled)
        before, after = self.launch_hooks
        before()
        result = self._launch(scheduled)
        after()
        return result

    def _launch(self, scheduled: list[ScheduledSequence]) -> StepResult:
        self.sampler.commit()
        result = StepResult(self.sampler.vocab_size)
        if not scheduled:
            return result
        batch = self.prepare(scheduled)
        if self._faults is not None:
            self._faults.check_forward([item.seq for item in scheduled])
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:  # no graph for this step (or none at all): eager
            hidden = self.model.forward(
                batch.token_ids, batch.positions, self.kv_caches, batch.meta
            )
        self.forward_end = time.perf_counter()  # read by Engine.step for StepTiming
        if not batch.sampling_seqs:
            return result
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        if batch.drafts is not None:
            emitted, emitted_logprobs = self.sampler.sample_drafts(
                logits, batch.sampling_seqs, batch.drafts
            )
            result.add_emitted(batch.sampling_seqs, emitted, emitted_logprobs)
            return result
        tokens, logprobs = self.sampler.sample_on_device(logits, batch.sampling_seqs)
        for row, seq in enumerate(batch.sampling_seqs):
            self._step_ids[seq.request_id] = (tokens, row)
        result.add(batch.sampling_seqs, tokens, logprobs)
        return result

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables, sample_rows, sampling = [], [], [], [], []
        drafts: list[tuple[int, ...]] = []
        pending: list[tuple[int, str]] = []  # (flat row, request): ids the last step sampled
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            draft = item.draft_token_ids
            end = start + item.num_new_tokens
            own_end = end - len(draft)
            if own_end > seq.num_known_tokens:  # only a decode's one input can be pending
                pending.append((len(token_ids) + item.num_own_tokens - 1, seq.request_id))
            token_ids.extend(seq.token_ids_slice(start, own_end))
            token_ids.extend(draft)
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(seq.block_ids)
            if item.samples:
                sample_rows.extend(range(len(token_ids) - 1 - len(draft), len(token_ids)))
                sampling.append(seq)
                drafts.append(draft)
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, self.block_size, device=self.device
        )
        ids = device_tensor(token_ids, torch.int64, self.device)
        if pending:
            self._fill_placeholders(ids, pending)
        return StepBatch(
            token_ids=ids,
            positions=device_tensor(positions, torch.int64, self.device),
            meta=meta,
            sample_rows=device_tensor(sample_rows, torch.int64, self.device),
            sampling_seqs=sampling,
            drafts=drafts if any(drafts) else None,
        )

    def _fill_placeholders(self, ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """Put the previous step's sampled ids (still on the device) at the pending rows.
        An id out of range is clamped here, so the embedding lookup never fails the whole
        step; the previous step's ``resolve`` reports its request, whose later tokens go."""
        sources = []
        for _, request_id in pending:
            source = self._prev_ids.get(request_id)
            if source is None:
                raise RuntimeError(f"{request_id}: no sampled id for its pending token")
            sources.append(source)
        tensors = {id(t): t for t, _ in sources}
        if len(tensors) == 1:  # one run made the previous step: one gather
            [tensor] = tensors.values()
            index = device_tensor([row for _, row in sources], torch.int64, tensor.device)
            values = tensor[index]
        else:  # the previous step ran in parts (fault isolation)
            values = torch.stack([t[row] for t, row in sources])
        rows = device_tensor([row for row, _ in pending], torch.int64, ids.device)
        ids[rows] = values.clamp(0, self.sampler.vocab_size - 1)

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

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole device blocks (src, dst) in every layer, keys and values (int8 rows
        carry their scales), queued on the device like the step's forward."""
        if not pairs:
            return
        src = device_tensor([p[0] for p in pairs], torch.int64, self.device)
        dst = device_tensor([p[1] for p in pairs], torch.int64, self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]


def _checked(
    seqs: list[Sequence], token_ids: list[int], logprobs, vocab_size: int
) -> ModelRunnerOutput:
    """The output, with rows whose id is outside [0, vocab) moved to ``faulty``: such an
    id must never reach the embedding lookup (it would fail the whole next step)."""
    out = ModelRunnerOutput([], [], [])
    for seq, token, logprob in zip(seqs, token_ids, logprobs, strict=True):
        if 0 <= token < vocab_size:
            out.request_ids.append(seq.request_id)
            out.sampled_token_ids.append(token)
            out.logprobs.append(logprob)
        else:
            out.faulty[seq.request_id] = BAD_TOKEN_MESSAGE
    return out

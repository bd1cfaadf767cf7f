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
    CacheConfig,
    EngineConfig,
    ModelConfig,
)
from compute.core.outputs import ScheduledSequence, SchedulerOutput
from compute.models.decoder import DecoderModel
from compute.runner.cuda_graphs import DecodeGraphs, capture_or_eager
from compute.runner.fault_isolation import FAULT_MESSAGE, launch_isolating
from compute.runner.kv_sizing import gpu_num_blocks
from compute.runner.step_batch import StepBatch
from compute.runner.step_result import StepResult
from compute.sampling.fault_hook import FaultHook
from compute.sampling.sampler import Sampler
from kernels.log import get_logger
from kernels.metadata import AttentionMetadata
from kernels.reference import kv_row_width
from kernels.transfer import device_tensor

log = get_logger(__name__)
GIB = 1024**3


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
    """KV blocks when --num-blocks is unset: --kv-cache-memory-gib when given, else on a GPU
    what --gpu-memory-utilization leaves (compute/runner/kv_sizing.py) and, on the CPU,
    max_num_seqs * CPU_KV_TOKENS_PER_SEQ tokens (>= one max_model_len)."""
    cache = config.cache
    if cache.memory_gib is not None:
        return blocks_for_memory(model, cache, cache.memory_gib, dtype)
    if device.type != "cpu":
        block_bytes = kv_bytes_per_block(model, cache.block_size, dtype)
        return gpu_num_blocks(config, model, device, dtype, block_bytes, max_model_len)
    tokens = max(config.scheduler.max_num_seqs * CPU_KV_TOKENS_PER_SEQ, max_model_len)
    return -(-tokens // cache.block_size)


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

    @property
    def vocab_size(self) -> int:
        return self.sampler.vocab_size

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose decode steps replay a captured graph (empty: none)."""
        return self.graphs.captured if self.graphs is not None else ()

    def capture_graphs(self, wanted: bool | None, max_num_seqs: int, max_model_len: int) -> None:
        """CUDA graphs of decode steps when asked (``wanted``: True, False or None for the
        default, on for CUDA). A capture that fails raises when graphs were asked for; by
        default it is logged (an error) and steps run eagerly: slower, not wrong
        (compute/runner/cuda_graphs.py). Mixture-of-experts models pick their experts on
        the host (compute/models/moe.py), so they run eagerly."""
        if self.device.type != "cuda":
            if wanted:
                log.info("cuda graphs: ignored on the CPU", device=str(self.device))
            return
        if wanted is False:
            return
        if self.model.config.num_experts:
            if wanted:
                raise ValueError("cuda_graphs: mixture-of-experts models run eagerly")
            log.info("cuda graphs: off for a mixture-of-experts model (eager steps)")
            return
        self.graphs = capture_or_eager(
            lambda: DecodeGraphs(
                self.model, self.kv_caches, self.block_size, max_num_seqs, max_model_len
            ),
            wanted,
        )

    def forget(self, request_id: str) -> None:
        """The request has ended: drop its per-request sampling state."""
        self.sampler.forget(request_id)

    def rewind(self) -> None:
        """A launch failed: put the sampler's generators back where the step began."""
        self.sampler.rewind()

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

    def run(self, sched: SchedulerOutput) -> StepResult:
        """One scheduled step: its block copies, then forward and sample, a request that
        makes the launch fail isolated (its id in the result's ``faulty``)."""
        self.swap(sched)
        self.begin_step()
        return launch_isolating(self, sched.scheduled)

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
        mask_before = self.sampler.grammars.mask_seconds
        self._forward_and_sample(scheduled, result)
        result.mask_seconds = self.sampler.grammars.mask_seconds - mask_before
        return result

    def _forward_and_sample(self, scheduled: list[ScheduledSequence], result: StepResult) -> None:
        batch = self.prepare(scheduled)
        if self._faults is not None:
            self._faults.check_forward([item.seq for item in scheduled])
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:  # no graph for this step (or none at all): eager
            hidden = self.model.forward(
                batch.token_ids, batch.positions, self.kv_caches, batch.meta
            )
        result.forward_end = time.perf_counter()
        if not batch.sampling_seqs:
            return
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        if batch.drafts is not None:
            emitted, emitted_logprobs = self.sampler.sample_drafts(
                logits, batch.sampling_seqs, batch.drafts
            )
            result.add_emitted(batch.sampling_seqs, emitted, emitted_logprobs)
            return
        tokens, logprobs = self.sampler.sample_on_device(logits, batch.sampling_seqs)
        for row, seq in enumerate(batch.sampling_seqs):
            self._step_ids[seq.request_id] = (tokens, row)
        result.add(batch.sampling_seqs, tokens, logprobs)
        for request_id, reason in self.sampler.take_faulty().items():
            log.warning("grammar failed; failing its request alone", request_id=request_id,
                        reason=reason)  # fmt: skip
            result.faulty[request_id] = FAULT_MESSAGE

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

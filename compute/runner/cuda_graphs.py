"""CUDA graphs of decode steps (``--cuda-graphs``, on by default for CUDA).

A decode step of a small model is hundreds of small kernel launches, each a few
microseconds of work and several of launch overhead; a CUDA graph replays them all with
one launch. One graph per bucketed batch size (1, 2, 4, ... and max_num_seqs), captured
at start-up over static input buffers. A pure-decode step of n sequences whose contexts
fit the graphs' context cap is copied into the buffers of the smallest bucket >= n,
padded with rows that write nowhere (slot -1) and read one cache slot (context 1 on
block 0, whatever it holds; their outputs are dropped), and replayed; its first n
hidden rows are the step's. Prefill and mixed steps, bigger batches and longer contexts
run eagerly. Sampling stays outside the graph: it is a few launches, it differs by
request (greedy, top-p, penalties, seeded generators) and it is cheap beside the model.

The graphs are captured with every row's host-side context length at the cap, so the
attention plan (the decode kernel's partitions, kernels/cuda/attention_plan.py) covers any
context up to it; the kernels read the actual lengths from the device buffer and skip
partitions past them. All graphs share one memory pool, captured largest first.

``capture=False`` runs the same padded buffers eagerly: the CPU tests check the buffer
bookkeeping that way (everything here but the capture and replay). On CUDA it plans
attention as the capture did (every row at the cap), so it computes what a replay does.

A capture that fails (something in the step synchronised, memory ran out) raises
CaptureError after undoing what torch leaves behind (the capture stream as the current
stream, the allocator still allocating to the graphs' pool); later captures in the process
are refused. ``capture_or_eager`` is the policy: graphs asked for explicitly (tests,
benchmarks, ``--cuda-graphs true``) fail with it; by default the engine logs the reason
once, as an error, and runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kernels.log import get_logger
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from compute.models.decoder import DecoderModel
    from compute.runner.step_batch import StepBatch

log = get_logger(__name__)
# Longest context a captured step may hold: the decode plan's partitions (and workspace)
# are sized for it at capture, so a larger cap costs every replayed step more empty
# partitions and memory. Longer contexts run eagerly.
MAX_GRAPH_CONTEXT = 8192
# Why a capture in this process failed, once one did: later captures are refused, since a
# failed capture may leave the allocator or the device in a state no later one survives.
_failed_capture: str | None = None


class CaptureError(RuntimeError):
    """The decode graphs could not be captured (the reason in the message and __cause__)."""


def capture_or_eager(make: Callable[[], DecodeGraphs], wanted: bool | None) -> DecodeGraphs | None:
    """``make()``'s graphs; if the capture fails: raise when graphs were asked for
    explicitly (``wanted`` True), else log why (an error, with the traceback, the first
    time in the process) and return None: decode steps run eagerly, slower, not wrong."""
    first = _failed_capture is None
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - the capture, or the buffers (out of memory)
        if wanted:
            raise
        if first:
            log.error("cuda graph capture failed: decode steps run eagerly", reason=str(exc),
                      exc_info=True)  # fmt: skip
        else:
            log.warning("cuda graphs off: decode steps run eagerly", reason=str(exc))
        return None


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Static decode buffers and one graph per bucket; ``run`` serves a step or declines."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_context = min(max_model_len, MAX_GRAPH_CONTEXT)
        rows, device = self.buckets[-1], model.device
        width = -(-self.max_context // block_size)
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.context = torch.ones(rows, dtype=torch.int32, device=device)
        self.starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0
        self.replays = 0  # steps served by a graph (or, without capture, by the buffers)
        if capture:
            self._capture()

    @property
    def captured(self) -> tuple[int, ...]:
        """Batch sizes with a captured graph."""
        return tuple(sorted(self._graphs))

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's hidden rows [n, H] from a bucket, or None: run it eagerly."""
        meta = batch.meta
        n = meta.num_seqs
        if (
            n == 0
            or not meta.is_pure_decode
            or n > self.buckets[-1]
            or meta.max_context_len > self.max_context
            or meta.block_tables.shape[1] > self.tables.shape[1]
        ):
            return None
        size = next(b for b in self.buckets if b >= n)
        self._fill(batch, n, size)
        self.replays += 1
        if size in self._graphs:
            graph, out = self._graphs[size]
            graph.replay()
            return out[:n]
        if self.model.device.type == "cuda":  # the captured plan: the same kernels and sizes
            padded = [self.max_context] * size
        else:  # the torch reference and the CPU kernels read the host lengths
            padded = [*meta.context_lens_host, *([1] * (size - n))]
        return self._forward(size, padded)[:n]

    def _fill(self, batch: StepBatch, n: int, size: int) -> None:
        """Rows [0, n) from the step, rows [n, size) padding (device-side copies only)."""
        meta, width = batch.meta, batch.meta.block_tables.shape[1]
        self.ids[:n].copy_(batch.token_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :width].copy_(meta.block_tables)
        self.tables[:n, width:].zero_()
        self.context[:n].copy_(meta.context_lens)
        if size > n:
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(-1)
            self.tables[n:size].zero_()
            self.context[n:size].fill_(1)

    def _meta(self, size: int, contexts: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            context_lens=self.context[:size],
            query_start_loc=self.starts[: size + 1],
            query_lens=[1] * size,
            context_lens_host=contexts,
            max_query_len=1,
            max_context_len=max(contexts),
        )

    def _forward(self, size: int, contexts: list[int]) -> torch.Tensor:
        meta = self._meta(size, contexts)
        return self.model.forward(self.ids[:size], self.positions[:size], self.kv_caches, meta)

    def _capture(self) -> None:
        """Every bucket, largest first into one shared pool, after an eager warm-up of each
        on a side stream (lazy initialisations and workspace sizes happen outside capture).
        The buffers hold padding rows meanwhile: nothing is written to the cache."""
        global _failed_capture
        if _failed_capture is not None:
            raise CaptureError(f"an earlier capture in this process failed: {_failed_capture}")
        start = time.perf_counter()
        stream, pool = None, None
        try:
            stream = torch.cuda.current_stream()
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            order = sorted(self.buckets, reverse=True)
            self._warm_up(stream, order)
            pool = torch.cuda.graph_pool_handle()
            for size in order:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size, [self.max_context] * size)
                self._graphs[size] = (graph, out)
            torch.cuda.synchronize()
        except Exception as exc:
            _failed_capture = f"{type(exc).__name__}: {exc}"[:400]
            self._graphs.clear()
            _undo_failed_capture(stream, pool)
            raise CaptureError(f"cuda graph capture failed: {_failed_capture}") from exc
        self.capture_s = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_reserved() - before
        log.info(
            "cuda graphs captured", batch_sizes=list(self.captured), max_context=self.max_context,
            seconds=round(self.capture_s, 2), memory_mib=round(self.memory_bytes / 2**20, 1),
        )  # fmt: skip

    def _warm_up(self, stream: torch.cuda.Stream, order: list[int]) -> None:
        """One eager forward of every bucket on a side stream, joined back to ``stream``."""
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for size in order:
                self._forward(size, [self.max_context] * size)
        stream.wait_stream(side)


def _undo_failed_capture(stream: torch.cuda.Stream | None, pool: object) -> None:
    """What torch.cuda.graph leaves behind when its capture_end raises (it skips the rest
    of its exit): the capture stream as the current stream, and the caching allocator
    still sending this stream's allocations to the graphs' pool. Best effort: each undo
    that does not apply (nothing was left) raises, and is ignored."""
    if stream is None:  # it failed before anything began
        return
    torch.cuda.set_stream(stream)
    if pool is not None:
        with contextlib.suppress(Exception):  # the allocator was not capturing: nothing to do
            torch._C._cuda_endAllocateToPool(stream.device.index or 0, pool)

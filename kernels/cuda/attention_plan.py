"""What one step's paged-attention launches look like, worked out once per step.

Every layer of a step calls kernels.cuda.paged_attention with the same
AttentionMetadata and tensors of the same shapes, so the argument checks
(O(num_seqs) Python over the metadata's host lists) and the launch geometry are
computed for the first layer and reused by the other 29: ``plan_for`` keeps the
last plan, keyed by the metadata object and the tensors' shapes and dtypes. Per
layer only what can differ between layers' tensors is checked again (contiguity
and 16-byte alignment of query and caches).

The decode partition size is chosen here too (``decode_partition_size``), and a sliding
window's decode grid (``AttentionPlan.decode_partitions_within``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cuda.checks import ATTENTION_DTYPES, check_metadata, check_query_and_cache
from kernels.metadata import AttentionMetadata

MAX_GROUP = 8  # kMaxGroup, paged_attention_decode.cu: query heads one decode block serves
# The decode kernel's partition sizes, largest first; 512 is kPartitionSize, the size of its
# logits buffer, and every size is a multiple of the largest block size (32).
PARTITION_SIZES = (512, 256, 128, 64)
_DEFAULT_SMS = 132  # an H100 / H200, for planning where no device can be asked


@dataclass(frozen=True)
class AttentionPlan:
    """The sizes and launch geometry of one step's attention, the same for every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    table_width: int
    dtype_suffix: str
    covered: bool  # the sequences own every query row (else unowned rows are zeroed)
    decode_partition_size: int  # 0: no decode sequence in the step
    decode_partitions: int  # grid.z of the decode kernel (over its longest context)
    prefill_longest: int  # longest query of a prefill sequence; 0: none in the step

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_chunks(self) -> int:
        return -(-self.group // MAX_GROUP)

    def decode_partitions_within(self, window: int) -> int:
        """grid.z of a layer's decode launch: every partition of the longest context, or
        with a window (> 0) the most partitions its keys can touch, whatever their alignment
        (the kernel runs a sequence's partitions from the first holding a visible key).
        Independent of the actual contexts, so a captured CUDA graph stays valid."""
        if window <= 0:
            return self.decode_partitions
        return min(self.decode_partitions, -(-(window - 1) // self.decode_partition_size) + 1)


def decode_partition_size(thread_blocks_per_partition: int, longest: int, sm_count: int) -> int:
    """The largest partition size whose decode grid gives every SM a thread block.

    `thread_blocks_per_partition` is decode sequences x KV heads x group chunks. Large
    batches get 512 (fewest partial results to merge); a small batch gets smaller partitions
    so its long contexts spread over the GPU (SmolLM2 at batch 1 and context 2048: 3 blocks
    of 512 tokens x 4 partitions = 12 thread blocks at 512; 96 at 64). Short contexts cannot
    fill it whatever the size: then the smallest partition that still splits them is used.
    """
    for size in PARTITION_SIZES:
        if thread_blocks_per_partition * -(-longest // size) >= sm_count:
            return size
    return PARTITION_SIZES[-1]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 where no CUDA device can be asked)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return _DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_sm_cache: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _sm_cache:
        _sm_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_cache[index]


def build_plan(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, meta: AttentionMetadata
) -> AttentionPlan:
    """Checks every argument (ValueError naming it) and works out the launches."""
    check_query_and_cache(query, key_cache, value_cache)
    if meta.num_seqs:
        check_metadata(meta, query.shape[0], key_cache.shape[1], query.device)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group_chunks = -(-(num_heads // num_kv_heads) // MAX_GROUP)
    pairs = list(zip(meta.query_lens, meta.context_lens_host, strict=True))
    decode_contexts = [c for q, c in pairs if q == 1]
    size = parts = 0
    if decode_contexts:
        longest = max(decode_contexts)
        blocks = len(decode_contexts) * num_kv_heads * group_chunks
        size = decode_partition_size(blocks, longest, sm_count(query.device))
        parts = max(1, -(-longest // size))
    return AttentionPlan(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=query.shape[2],
        block_size=key_cache.shape[1],
        table_width=meta.block_tables.shape[1] if meta.num_seqs else 0,
        dtype_suffix=ATTENTION_DTYPES[query.dtype],
        covered=sum(meta.query_lens) == query.shape[0],
        decode_partition_size=size,
        decode_partitions=parts,
        prefill_longest=max((q for q, _ in pairs if q >= 2), default=0),
    )


@dataclass
class _Cached:
    meta: weakref.ReferenceType
    key: tuple
    plan: AttentionPlan


_last: _Cached | None = None


def plan_for(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, meta: AttentionMetadata
) -> AttentionPlan:
    """The step's plan: built (and checked) at the first layer, reused by the others."""
    global _last
    key = (
        tuple(query.shape),
        query.dtype,
        query.device,
        tuple(key_cache.shape),
        key_cache.dtype,
        key_cache.device,
        tuple(value_cache.shape),
        value_cache.dtype,
        value_cache.device,
    )
    cached = _last
    if cached is not None and cached.meta() is meta and cached.key == key:
        _check_layer(query, key_cache, value_cache)
        return cached.plan
    plan = build_plan(query, key_cache, value_cache, meta)
    _last = _Cached(weakref.ref(meta), key, plan)
    return plan


def _check_layer(query: Tensor, key_cache: Tensor, value_cache: Tensor) -> None:
    """What another layer's tensors of the same shapes can still get wrong."""
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (the kernels load 16 B)")

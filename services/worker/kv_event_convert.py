"""KV-event records and load samples -> the worker protocol's ``KvEventBatch`` (smg.grpc.common).

One ``KvBlocksStored`` per chain stored in a turn (consecutive blocks, each the parent of
the next, under one salt; the chain's ``parent_block_hash`` names the block it continues),
one ``KvBlocksRemoved`` per run of removals, ``KvCacheCleared`` as is. Every batch carries
the engine's load (``EngineLoad``): the routing core always; the rest of the telemetry on a
stream's first record and on load-only ones, as the protocol asks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from smg_grpc_proto.generated import common_pb2 as pb

from compute.core.kv_events import BlockRemoved, BlockStored, KvEvent
from services.pipeline.engine_load import LoadSample
from services.pipeline.kv_subscription import Outgoing

GIB = 1024**3


def batch_to_pb(
    record: Outgoing, load: LoadSample, sample: int, event_ids: Iterator[int]
) -> pb.KvEventBatch:
    """One stream record; ``sample`` numbers its load record, ``event_ids`` its events."""
    batch = record.batch
    load_only = batch is None
    message = pb.KvEventBatch(
        sequence_number=record.sequence_number,
        timestamp=batch.timestamp if batch is not None else time.time(),
        load=load_to_pb(load, sample, load_only, full=load_only or record.first),
    )
    if batch is not None:
        message.events.extend(events_to_pb(batch.events, event_ids))
    return message


def events_to_pb(events: tuple[KvEvent, ...], event_ids: Iterator[int]) -> list[pb.KvCacheEvent]:
    out: list[pb.KvCacheEvent] = []
    for group in _groups(events):
        head = group[0]
        if isinstance(head, BlockStored):
            data = {"stored": _stored(group)}
        elif isinstance(head, BlockRemoved):
            removed = pb.KvBlocksRemoved(block_hashes=[e.block_hash for e in group])
            removed.tier = pb.KV_CACHE_TIER_DEVICE
            data = {"removed": removed}
        else:
            data = {"cleared": pb.KvCacheCleared()}
        out.append(pb.KvCacheEvent(event_id=next(event_ids), **data))
    return out


def _groups(events: tuple[KvEvent, ...]) -> list[list[KvEvent]]:
    """Runs of events one protocol event can carry: a stored chain, removals, a clear."""
    groups: list[list[KvEvent]] = []
    for event in events:
        last = groups[-1][-1] if groups else None
        if _continues(last, event):
            groups[-1].append(event)
        else:
            groups.append([event])
    return groups


def _continues(last: KvEvent | None, event: KvEvent) -> bool:
    if isinstance(last, BlockRemoved) and isinstance(event, BlockRemoved):
        return True
    return (
        isinstance(last, BlockStored)
        and isinstance(event, BlockStored)
        and event.parent_hash == last.block_hash
        and event.cache_salt == last.cache_salt
    )


def _stored(chain: list[BlockStored]) -> pb.KvBlocksStored:
    blocks = [
        pb.KvBlock(block_hash=e.block_hash, token_ids=e.token_ids, block_size=len(e.token_ids))
        for e in chain
    ]
    stored = pb.KvBlocksStored(
        blocks=blocks, tier=pb.KV_CACHE_TIER_DEVICE, locality=pb.KV_CACHE_LOCALITY_LOCAL
    )
    if chain[0].parent_hash is not None:
        stored.parent_block_hash = chain[0].parent_hash
    if chain[0].cache_salt:
        stored.cache_salt = chain[0].cache_salt
    return stored


def load_to_pb(load: LoadSample, sample: int, load_only: bool, full: bool) -> pb.EngineLoad:
    """The routing core always; with ``full``, the telemetry the engine reports too."""
    stats = load.stats
    record = pb.EngineLoad(
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting + stats.num_swapped,  # preempted ones wait too
        token_usage=stats.kv_usage,
        active_token_usage=stats.kv_usage,  # parked prefix-cache blocks count as free
        gen_throughput=load.gen_throughput,
        max_running_requests=load.shape.max_running,
        age_ms=load.age_ms,
        sample=sample,
        load_only=load_only,
        engine_reports_steps=True,  # the step loop reports every turn (engine_load.py)
        prefill_pending_tokens=stats.prefill_pending_tokens,
    )
    if load.engine_silence_ms is not None:
        record.engine_silence_ms = load.engine_silence_ms
    if full:
        _telemetry(record, load)
    return record


def _telemetry(record: pb.EngineLoad, load: LoadSample) -> None:
    stats, shape = load.stats, load.shape
    if load.cache_hit_rate is not None:
        record.cache_hit_rate = load.cache_hit_rate
    record.num_used_tokens = stats.kv_slots_used
    record.max_total_num_tokens = shape.token_capacity
    if shape.weight_bytes is not None and shape.kv_cache_bytes is not None:
        record.memory.CopyFrom(
            pb.EngineMemory(
                weight_gb=shape.weight_bytes / GIB,
                kv_cache_gb=shape.kv_cache_bytes / GIB,
                token_capacity=shape.token_capacity,
            )  # graph_gb: CUDA graphs' memory is not measured (0)
        )
    if stats.spec_draft_tokens:
        verifying = stats.spec_emitted_tokens - stats.spec_accepted_tokens
        record.speculative.CopyFrom(
            pb.EngineSpeculative(
                accept_rate=stats.spec_accepted_tokens / stats.spec_draft_tokens,
                accept_length=stats.spec_emitted_tokens / max(verifying, 1),
            )
        )

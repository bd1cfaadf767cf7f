"""SubscribeKvEvents against the generated stubs, over the real engine on dummy weights.

The events come from the block manager (compute/core/prefix_cache.py) through the step
loop and the hub (services/pipeline/kv_event_hub.py): every full prompt block stored, with
its chained hash, its token ids and its parent; every block evicted or flushed removed;
load records on every batch and as heartbeats. Subscribers resume from a sequence
number, several read at once, and one that stops reading is dropped, never waited for.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.kv_events import public_hash
from compute.core.prefix_cache import block_key
from tests.conftest import RunningServer
from tests.support.waiting import wait_until

TIMEOUT = 30
BLOCK = 16


def tiny_engine(num_blocks: int = 64):
    from compute.engine import Engine

    return Engine(
        EngineConfig(
            model="dummy:tiny",
            cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_seqs=8),
            device=DeviceConfig(device="cpu", num_threads=1),
        )
    )


@pytest.fixture
def tiny(serve) -> RunningServer:
    return serve(tiny_engine())


class Subscriber:
    """A SubscribeKvEvents stream read on a thread of its own (so tests can wait on it)."""

    def __init__(self, running: RunningServer, start: int = 0, early_loads: bool = True):
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=early_loads
        )
        self.call = stub(running).SubscribeKvEvents(request, timeout=120)
        self.batches: queue.Queue = queue.Queue()
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError as exc:
            self.error = exc
        self.batches.put(None)

    def next(self, accept: Callable[[common_pb2.KvEventBatch], bool], timeout: float = TIMEOUT):
        """The first batch ``accept`` takes, skipping others; fails on timeout or the end."""
        deadline = time.monotonic() + timeout
        while True:
            batch = self.batches.get(timeout=max(0.01, deadline - time.monotonic()))
            assert batch is not None, f"stream ended: {self.error}"
            if accept(batch):
                return batch

    def events(self, timeout: float = TIMEOUT) -> common_pb2.KvEventBatch:
        return self.next(lambda b: bool(b.events), timeout)

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture
def subscribers() -> Iterator[list[Subscriber]]:
    opened: list[Subscriber] = []
    yield opened
    for subscriber in opened:
        subscriber.close()


def stub(running: RunningServer) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(running.channel())


def generate(running: RunningServer, ids: list[int], request_id: str = "r", max_tokens: int = 2):
    request = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        stream=False,
    )
    (response,) = stub(running).Generate(request, timeout=TIMEOUT)
    return response.complete


def prompt(seed: int, blocks: int = 3) -> list[int]:
    """``blocks`` full blocks and one token more (the last token is always computed)."""
    return [(seed * 7919 + i * 31) % 500 + 1 for i in range(blocks * BLOCK + 1)]


def stored_blocks(batch: common_pb2.KvEventBatch) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent hash, token ids) of every stored block, in order."""
    out = []
    for event in batch.events:
        if event.HasField("stored"):
            parent = (
                event.stored.parent_block_hash
                if event.stored.HasField("parent_block_hash")
                else None
            )
            for block in event.stored.blocks:
                out.append((block.block_hash, parent, list(block.token_ids)))
                parent = block.block_hash
    return out


def expected_chain(ids: list[int], num_blocks: int, salt: str | None = None) -> list[tuple]:
    chain, key = [], None
    for i in range(num_blocks):
        tokens = ids[i * BLOCK : (i + 1) * BLOCK]
        parent = None if key is None else public_hash(key)
        key = block_key(key, tokens, salt)
        chain.append((public_hash(key), parent, tokens))
    return chain


def test_stored_blocks_carry_chained_hashes_and_token_ids(tiny, subscribers) -> None:
    subscribers.append(sub := Subscriber(tiny))
    ids = prompt(1)
    generate(tiny, ids)
    batch = sub.events()
    assert stored_blocks(batch) == expected_chain(ids, 3)
    stored = next(e.stored for e in batch.events if e.HasField("stored"))
    assert all(b.block_size == BLOCK for b in stored.blocks)
    assert stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
    assert not stored.HasField("cache_salt")
    assert batch.sequence_number > 0 and batch.HasField("load")


def test_a_fresh_subscriber_gets_the_cache_as_a_snapshot_first(tiny, subscribers) -> None:
    ids = prompt(2)
    generate(tiny, ids)
    subscribers.append(sub := Subscriber(tiny))
    snapshot = sub.events()
    assert snapshot.events[0].HasField("cleared")
    assert stored_blocks(snapshot) == expected_chain(ids, 3)
    generate(tiny, prompt(3))  # live batches continue right after it
    assert sub.events().sequence_number == snapshot.sequence_number + 1


def test_resume_from_a_sequence_number_replays_the_missed_batches(tiny, subscribers) -> None:
    subscribers.append(first := Subscriber(tiny))
    generate(tiny, prompt(4))
    seen = first.events()
    generate(tiny, prompt(5))
    missed = first.events()
    subscribers.append(resumed := Subscriber(tiny, start=seen.sequence_number))
    replayed = resumed.events()
    assert replayed.sequence_number == missed.sequence_number
    assert stored_blocks(replayed) == stored_blocks(missed) == expected_chain(prompt(5), 3)
    # A cursor past this server's history (a gateway's, from before a restart) is refused.
    stale = Subscriber(tiny, start=seen.sequence_number - 10**9)
    wait_until(lambda: stale.error is not None, TIMEOUT, "the stale cursor refused")
    assert stale.error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "start_sequence_number" in stale.error.details()


def test_two_subscribers_get_the_same_batches(tiny, subscribers) -> None:
    subscribers.extend([a := Subscriber(tiny), b := Subscriber(tiny)])
    generate(tiny, prompt(6))
    first, second = a.events(), b.events()
    assert first.sequence_number == second.sequence_number
    assert stored_blocks(first) == stored_blocks(second) == expected_chain(prompt(6), 3)
    assert tiny.metrics.registry.get_sample_value("headrace_kv_event_subscribers") == 2


def test_idle_heartbeats_are_load_only_records(tiny, subscribers) -> None:
    subscribers.append(early := Subscriber(tiny))
    beats = [early.next(lambda b: b.load.load_only) for _ in range(3)]
    assert all(b.sequence_number == 0 and not b.events for b in beats)  # before any batch
    assert [b.load.sample for b in beats] == sorted(b.load.sample for b in beats)
    idle = beats[-1].load
    assert not idle.HasField("engine_silence_ms")  # nothing in flight: silence means nothing
    assert idle.engine_reports_steps and idle.max_running_requests == 8
    assert idle.max_total_num_tokens == 64 * BLOCK and idle.HasField("memory")
    # A subscriber that did not ask for records before the first batch gets none then.
    subscribers.append(late := Subscriber(tiny, early_loads=False))
    generate(tiny, prompt(7))
    first = late.next(lambda b: True)
    assert first.events and first.sequence_number > 0
    after = late.next(lambda b: b.load.load_only)  # heartbeats follow, numbered as it
    assert after.sequence_number == first.sequence_number


def test_load_reports_running_requests_and_the_engine_silence(serve, subscribers) -> None:
    running = serve(tiny_engine())
    subscribers.append(sub := Subscriber(running))
    slow = threading.Thread(target=generate, args=(running, prompt(8), "long", 400), daemon=True)
    slow.start()
    busy = sub.next(lambda b: b.load.running_requests == 1 and b.load.HasField("engine_silence_ms"))
    assert busy.load.engine_silence_ms < 10_000  # the engine reports every step
    slow.join(TIMEOUT)
    idle = sub.next(lambda b: b.load.running_requests == 0 and b.load.load_only)
    assert not idle.load.HasField("engine_silence_ms")


def test_a_subscriber_that_stops_reading_is_dropped_and_generation_goes_on(
    tiny, subscribers
) -> None:
    tiny.pipeline.kv_events.queue_size = 2
    # A client that reads nothing: a small flow-control window it never reopens, so the
    # server's writes stall after a few records, as behind a vanished peer.
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(tiny.target, options=options)
    stalled = common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=False)
    call = pb_grpc.VllmEngineStub(channel).SubscribeKvEvents(stalled, timeout=120)
    wait_until(lambda: tiny.pipeline.kv_events.subscribers == 1, TIMEOUT, "subscribed")
    dropped = "headrace_kv_event_subscribers_dropped_total"
    for i in range(200):  # each a batch; gRPC's flow-control window takes some first
        generate(tiny, prompt(100 + i, blocks=1), f"r{i}", max_tokens=1)
        if tiny.metrics.registry.get_sample_value(dropped, {"reason": "queue_full"}):
            break
    assert tiny.metrics.registry.get_sample_value(dropped, {"reason": "queue_full"}) == 1
    assert tiny.pipeline.kv_events.subscribers == 0
    with pytest.raises(grpc.RpcError) as info:  # what it buffered, then DATA_LOSS: resync
        list(call)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert "subscribe from 0" in info.value.details()


def test_flush_cache_removes_every_block_and_the_next_request_hits_nothing(
    tiny, subscribers
) -> None:
    subscribers.append(sub := Subscriber(tiny))
    ids = prompt(9)
    generate(tiny, ids)
    assert generate(tiny, ids, "again").cached_tokens == 3 * BLOCK
    stored = {h for h, _, _ in stored_blocks(sub.events())}
    answer = stub(tiny).FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert answer.success and answer.message.startswith("freed 3 cached KV blocks")
    removed = sub.next(lambda b: any(e.HasField("removed") for e in b.events))
    assert {h for e in removed.events for h in e.removed.block_hashes} == stored
    assert generate(tiny, ids, "after").cached_tokens == 0


def test_flush_cache_refuses_a_bad_timeout_naming_it(tiny) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub(tiny).FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("timeout_s:")


def test_with_kv_events_off_the_stream_is_unimplemented(serve) -> None:
    from services.server.server_config import ServerConfig

    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, kv_events=False)
    running = serve(tiny_engine(), config)
    call = stub(running).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--no-kv-events" in info.value.details()

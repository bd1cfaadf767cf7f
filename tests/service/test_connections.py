"""Connection limits on a real in-process server, with small values: an idle connection gets
a GOAWAY, a peer that never acks the keepalive ping is dropped, one that never finishes
its HTTP/2 set-up is dropped, and request metadata over the limit is refused the same
way every time."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.server.connection_config import ConnectionConfig
from services.server.server_config import ServerConfig

TIMEOUT = 30
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY = 4, 6, 7


def _config(**connection) -> ServerConfig:
    return ServerConfig(
        host="127.0.0.1", port=0, metrics_port=-1, connection=ConnectionConfig(**connection)
    )


def _frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", 0) + payload
    )


def _frames_until_closed(sock: socket.socket) -> list[int]:
    """Frame types the server sends until it closes the connection (or TIMEOUT passes)."""
    sock.settimeout(TIMEOUT)
    data, kinds = b"", []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return kinds
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            kinds.append(data[3])
            data = data[9 + int.from_bytes(data[:3], "big") :]


def test_idle_connection_gets_goaway(serve) -> None:
    running = serve(config=_config(max_connection_idle=0.3))
    channel = grpc.insecure_channel(running.target)
    states: list[grpc.ChannelConnectivity] = []
    went_idle = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        if grpc.ChannelConnectivity.READY in states and state == grpc.ChannelConnectivity.IDLE:
            went_idle.set()

    channel.subscribe(watch)
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == 1
    assert went_idle.wait(TIMEOUT), states  # the server's GOAWAY sends the channel to IDLE
    # The client reconnects on its next call.
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == 1
    channel.close()


def test_open_stream_keeps_connection_from_idling(serve) -> None:
    running = serve(config=_config(max_connection_idle=0.3))
    channel = grpc.insecure_channel(running.target)
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append)
    stub = health_pb2_grpc.HealthStub(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert next(watch).status == 1
    time.sleep(1.0)  # over the idle limit, but a call is open
    assert states[-1] == grpc.ChannelConnectivity.READY, states
    watch.cancel()
    channel.close()


def test_peer_that_never_acks_the_keepalive_ping_is_dropped(serve) -> None:
    running = serve(
        config=_config(max_connection_idle=0, keepalive_time=0.3, keepalive_timeout=0.3)
    )
    with socket.create_connection(("127.0.0.1", running.server.port), timeout=TIMEOUT) as sock:
        sock.sendall(PREFACE + _frame(SETTINGS))  # a client that then vanishes
        kinds = _frames_until_closed(sock)
    assert PING in kinds and kinds[-1] == GOAWAY, kinds


def test_connection_that_never_sets_up_http2_is_dropped(serve) -> None:
    running = serve(config=_config(max_connection_idle=0, handshake_timeout=0.3))
    with socket.create_connection(("127.0.0.1", running.server.port), timeout=TIMEOUT) as sock:
        kinds = _frames_until_closed(sock)  # says nothing at all
    assert kinds[-1:] == [GOAWAY], kinds


@pytest.mark.parametrize(
    ("metadata", "has_message"),
    [
        # grpc's message lists every header up to the limit; for 300 tiny entries that list
        # outgrows what its HPACK encoder sends (about 2 KiB) and the message arrives empty.
        ([(f"x-key-{i}", "v" * 10) for i in range(300)], False),
        ([("x-big", "v" * 10_000)], True),  # between grpc's default soft and hard limits
    ],
    ids=["300-entries", "one-10k-value"],
)
def test_metadata_over_the_limit_is_refused_every_time(serve, metadata, has_message) -> None:
    running = serve(config=_config(max_metadata_bytes=8192))
    stub = health_pb2_grpc.HealthStub(running.channel())
    for _ in range(5):  # grpc's default limits refuse such calls at random
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        if has_message:
            assert info.value.details().startswith("received metadata size exceeds hard limit")
    fits = [(f"x-key-{i}", "v" * 10) for i in range(50)]
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT, metadata=fits).status == 1


def test_connection_config_validation_and_options() -> None:
    options = dict(ConnectionConfig(max_connection_idle=2.5, keepalive_timeout=4).grpc_options())
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.http2.ping_timeout_ms"] == options["grpc.keepalive_timeout_ms"] == 4000
    assert options["grpc.max_metadata_size"] == options["grpc.absolute_max_metadata_size"]
    assert "grpc.max_connection_idle_ms" not in dict(
        ConnectionConfig(max_connection_idle=0).grpc_options()
    )
    for bad in ({"keepalive_time": 0}, {"max_connection_idle": -1}, {"max_metadata_bytes": 100}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConnectionConfig(**bad)

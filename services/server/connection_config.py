"""How the server treats connections: idle limit, keepalive, handshake and metadata limits.

An idle connection (no call open) gets a GOAWAY after ``max_connection_idle``; the
client reconnects on its next call. The server pings a connection that has been silent
for ``keepalive_time`` and closes it when the ack does not come within
``keepalive_timeout``, so a peer that vanished (no FIN: power loss, a dropped NAT
entry) is noticed and its generations are cancelled. A connection that does not
finish its TLS and HTTP/2 set-up within ``handshake_timeout`` is closed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Clients may ping every 10 s (5 s leaves room for jitter) even with no call open.
CLIENT_PING_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


@dataclass(frozen=True)
class ConnectionConfig:
    max_connection_idle: float = 300.0  # seconds with no call open before GOAWAY; 0 = never
    keepalive_time: float = 30.0  # seconds of silence before the server pings
    keepalive_timeout: float = 10.0  # seconds to wait for the ping's ack, then close
    handshake_timeout: float = 20.0  # seconds for a new connection's TLS + HTTP/2 set-up
    # Request metadata (headers) limit. grpc's own default rejects between 8 and 16 KiB
    # at random; one limit (soft = hard) makes the answer the same every time.
    max_metadata_bytes: int = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name != "max_connection_idle"):
                raise ValueError(f"{f.name} must be positive, got {value}")
        if self.max_metadata_bytes < 1024:
            raise ValueError(f"max_metadata_bytes must be >= 1024, got {self.max_metadata_bytes}")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The grpc server options for these settings."""
        options = [
            ("grpc.keepalive_time_ms", _ms(self.keepalive_time)),
            ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout)),
            # grpc 1.85 closes on a missing ping ack after this (default 60 s), whatever
            # keepalive_timeout_ms says: measured with a peer that never acks.
            ("grpc.http2.ping_timeout_ms", _ms(self.keepalive_timeout)),
            ("grpc.server_handshake_timeout_ms", _ms(self.handshake_timeout)),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
            *CLIENT_PING_OPTIONS,
        ]
        if self.max_connection_idle > 0:
            options.append(("grpc.max_connection_idle_ms", _ms(self.max_connection_idle)))
        return options

"""The gRPC server's knobs: one frozen dataclass, validated once.

services/cli/cli_flags.py maps ``--flags`` and ``HEADRACE_*`` variables onto it; the
server (services/server/server.py) and servicer read it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.pipeline.input_limits import InputLimits
from services.security.security_config import SecurityConfig
from services.server.connection_config import ConnectionConfig

MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # interface for the gRPC and metrics listeners
    port: int = 50051  # gRPC port; 0 = any free port (tests)
    metrics_port: int = 9400  # Prometheus /metrics port; 0 = any free port, -1 = off
    max_message_bytes: int = 16 * MIB  # largest gRPC message sent or received
    grace_period: float = 30.0  # seconds streams in flight get to finish on SIGTERM
    max_batch_requests: int = 64  # most requests in one GenerateBatch call
    # Where serve writes the model's tokenizer for gateways (vLLM worker protocol's
    # GetModelInfo.tokenizer_path); "" = a fresh temporary directory.
    tokenizer_dir: str = ""
    # Connections older than this get a GOAWAY, so clients behind an L4 balancer reconnect
    # and spread over new replicas; 0 = never. Streams in flight then get the grace.
    max_connection_age: float = 0.0
    max_connection_age_grace: float = 300.0
    limits: InputLimits = field(default_factory=InputLimits)  # sizes checked before tokenizing
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)  # idle, keepalive
    security: SecurityConfig = field(default_factory=SecurityConfig)  # TLS, mTLS, token auth

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
        if self.max_connection_age < 0:
            raise ValueError(f"max_connection_age must be >= 0, got {self.max_connection_age}")
        if self.max_connection_age_grace < 0:
            raise ValueError(
                f"max_connection_age_grace must be >= 0, got {self.max_connection_age_grace}"
            )
        if self.max_batch_requests <= 0:
            raise ValueError(f"max_batch_requests must be positive, got {self.max_batch_requests}")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The grpc server's options: message size, connection age, idle, keepalive."""
        options = [
            *self.connection.grpc_options(),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if self.max_connection_age > 0:
            options += [
                ("grpc.max_connection_age_ms", int(self.max_connection_age * 1000)),
                ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace * 1000)),
            ]
        return options

    @property
    def address(self) -> str:
        """The gRPC listen address, IPv6 hosts bracketed."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

"""The gRPC server's knobs: one frozen dataclass, validated once.

services/cli/cli_flags.py maps ``--flags`` and ``HEADRACE_*`` variables onto it; the
server (services/server/server.py) and servicer read it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.api.input_limits import DEFAULT_MAX_BATCH_REQUESTS, InputLimits
from services.security.cache_isolation import CacheIsolation
from services.security.security_config import SecurityConfig
from services.server.connection_config import ConnectionConfig

MIB = 1024 * 1024
_MINIMA = (
    ("max_message_bytes", 1024), ("grace_period", 0),
    ("max_connection_age", 0), ("max_connection_age_grace", 0),
)  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # interface for the gRPC and metrics listeners
    port: int = 50051  # gRPC port; 0 = any free port (tests)
    metrics_port: int = 9400  # Prometheus /metrics port; 0 = any free port, -1 = off
    max_message_bytes: int = 16 * MIB  # largest gRPC message sent or received
    grace_period: float = 30.0  # seconds streams in flight get to finish on SIGTERM
    max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS  # most requests in one GenerateBatch call
    # Where serve writes the model's tokenizer for gateways (vLLM worker protocol's
    # GetModelInfo.tokenizer_path); "" = a fresh temporary directory.
    tokenizer_dir: str = ""
    # Connections older than this get a GOAWAY, so clients behind an L4 balancer reconnect
    # and spread over new replicas; 0 = never. Streams in flight then get the grace.
    max_connection_age: float = 0.0
    max_connection_age_grace: float = 300.0
    # Whose prefix cache a request runs in: "none" (shared, unless it names a cache_salt) or
    # "token" (its bearer token's tenant alone; needs --auth-token-file).
    cache_isolation: str = "none"
    # Where StartProfile/StopProfile write profiles of the step loop and stages; "" = off.
    profile_dir: str = ""
    # Stream the prefix cache's events and the engine's load (SubscribeKvEvents); off: that
    # call answers UNIMPLEMENTED and gateways fall back to their own guesses and polls.
    kv_events: bool = True
    limits: InputLimits = field(default_factory=InputLimits)  # sizes checked before tokenizing
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)  # idle, keepalive
    security: SecurityConfig = field(default_factory=SecurityConfig)  # TLS, mTLS, token auth

    def __post_init__(self) -> None:
        for name, low in (("port", 0), ("metrics_port", -1)):
            if not low <= (value := getattr(self, name)) <= 65535:
                raise ValueError(f"{name} must be in [{low}, 65535], got {value}")
        for name, low in _MINIMA:
            if (value := getattr(self, name)) < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.max_batch_requests <= 0:
            raise ValueError(f"max_batch_requests must be positive, got {self.max_batch_requests}")
        CacheIsolation(self.cache_isolation)  # ValueError naming the choices
        if self.cache_isolation == "token" and not self.security.auth:
            raise ValueError("--cache-isolation token needs --auth-token-file (tenants are tokens)")

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
    def isolation(self) -> CacheIsolation:
        return CacheIsolation(self.cache_isolation)

    @property
    def address(self) -> str:
        """The gRPC listen address, IPv6 hosts bracketed."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

"""The server's security wiring: what services/server/server.py asks of TLS and token auth.

``ServerSecurity`` turns a SecurityConfig into the live objects (the reloading
certificate files and token file), the interceptor that goes first, the listening
port (TLS or plaintext), the HTTP side port's TLS and /metrics check, and the start-up
warning for a server reachable from other machines with neither TLS nor auth.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Callable

import grpc

from kernels.log import get_logger
from services.security.auth import AuthInterceptor, bearer_token
from services.security.auth_tokens import TokenFile
from services.security.security_config import SecurityConfig
from services.security.tls import CertificateFiles
from services.telemetry.metrics import NO_METRICS, Metrics

log = get_logger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (0.0.0.0 and :: listen everywhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


class ServerSecurity:
    """The live TLS material and tokens of one server."""

    def __init__(self, config: SecurityConfig) -> None:
        self.config = config
        self.tokens = TokenFile(config.auth_token_file) if config.auth else None
        self.certificates = (
            CertificateFiles(config.tls_cert, config.tls_key, config.tls_client_ca or None)
            if config.tls
            else None
        )

    def interceptors(self, metrics: Metrics = NO_METRICS) -> list[grpc.aio.ServerInterceptor]:
        """The auth interceptor (to go first, outermost), or none without auth."""
        if self.tokens is None:
            return []
        return [AuthInterceptor(self.tokens, self.config.auth_reflection, metrics)]

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on ``address`` with TLS when configured; the bound port."""
        if self.certificates is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.certificates.server_credentials())

    @property
    def http_tls(self) -> Callable[[], ssl.SSLContext] | None:
        """The HTTP side port's TLS context source (the same certificate), or None."""
        return None if self.certificates is None else self.certificates.ssl_context

    @property
    def http_authorize(self) -> Callable[[str | None], bool] | None:
        """The /metrics check of an Authorization header, or None when /metrics is open."""
        tokens = self.tokens
        if tokens is None or not self.config.auth_metrics:
            return None

        def authorize(header: str | None) -> bool:
            token = bearer_token(header or "")
            return token is not None and tokens.accepts(token)

        return authorize

    def log_posture(self, host: str) -> None:
        """One line saying what protects the server; a warning when nothing does."""
        tls = "off" if self.certificates is None else "mutual" if self.certificates.mutual else "on"
        auth = "off" if self.tokens is None else "token"
        if tls == "off" and auth == "off" and not is_loopback(host):
            log.warning(
                "listening on a non-loopback address without TLS or auth: anyone who reaches "
                "the port can generate, read /metrics and reflect; see docs/security.md",
                host=host,
            )
        else:
            log.info("security", tls=tls, auth=auth, host=host)

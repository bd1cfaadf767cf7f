"""The server's TLS material (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``), reloaded
when the files change.

``read_certificates`` reads and checks the files once (start-up validation: a clear
ValueError naming the flag). ``CertificateFiles`` keeps the last good set and looks at
the files' stamps (mtime, size, inode; a Kubernetes secret update swaps a symlink) each
time a consumer asks: grpc asks before every TLS handshake through
``grpc.dynamic_ssl_server_credentials``, the HTTP side port for every connection. A
changed set that does not load (a half-written file, a key that does not match) is
logged once and the previous set is kept, so a bad rotation never takes the server
down. Connections already open keep the certificate they started with.
"""

from __future__ import annotations

import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from kernels.log import get_logger

CERT_FLAG, KEY_FLAG, CLIENT_CA_FLAG = "--tls-cert", "--tls-key", "--tls-client-ca"


def _no_password() -> bytes:  # without it OpenSSL prompts on the terminal
    return b""  # for an encrypted key, which then fails to load with a clear error


log = get_logger(__name__)


@dataclass(frozen=True)
class CertificateSet:
    """PEM bytes of the server certificate chain, its key, and the client CA (mTLS) if any."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


def read_flag_file(path: str, flag: str) -> bytes:
    """The bytes of the file a flag names; ValueError naming the flag when unreadable."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or 'error'}") from None


def read_certificates(cert: str, key: str, client_ca: str | None = None) -> CertificateSet:
    """The three files' bytes, checked: a PEM chain and the private key that matches it, and
    a PEM CA bundle; ValueError naming the flag otherwise."""
    loaded = CertificateSet(read_flag_file(cert, CERT_FLAG), read_flag_file(key, KEY_FLAG), None)
    if b"-----BEGIN CERTIFICATE-----" not in loaded.cert:
        raise ValueError(f"{CERT_FLAG}: {cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in loaded.key:
        raise ValueError(f"{KEY_FLAG}: {key} holds no PEM private key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"{CERT_FLAG}/{KEY_FLAG}: {cert} and {key} do not load as a certificate and its "
            f"unencrypted private key ({getattr(exc, 'reason', None) or 'ssl error'})"
        ) from None
    if client_ca is None:
        return loaded
    ca = read_flag_file(client_ca, CLIENT_CA_FLAG)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=ca.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError):
        raise ValueError(f"{CLIENT_CA_FLAG}: {client_ca} holds no PEM CA certificate") from None
    return CertificateSet(loaded.cert, loaded.key, ca)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class CertificateFiles:
    """The last good CertificateSet of three paths, re-read when a file changes; thread-safe."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self._paths = (cert, key, client_ca)
        self._lock = threading.Lock()
        self._stamps = self._current_stamps()
        self._failed: tuple | None = None  # stamps of a set that did not load (logged once)
        self.current = read_certificates(cert, key, client_ca)
        self.generation = 0  # +1 per reload, so each consumer sees every change
        self._grpc_generation = 0
        self._http: tuple[int, ssl.SSLContext] | None = None

    @property
    def mutual(self) -> bool:
        return self._paths[2] is not None

    def _current_stamps(self) -> tuple:
        return tuple(_stamp(p) if p else None for p in self._paths)

    def refresh(self) -> None:
        """Reload if a file changed since the last look (keeps the old set if it fails)."""
        with self._lock:
            stamps = self._current_stamps()
            if stamps in (self._stamps, self._failed):
                return
            try:
                loaded = read_certificates(*self._paths)
            except ValueError as exc:
                self._failed = stamps
                log.warning("TLS files do not load; keeping the old ones", error=str(exc))
                return
            self._stamps, self._failed = stamps, None
            self.current = loaded
            self.generation += 1
            log.info("TLS certificates reloaded", generation=self.generation)

    def grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        current = self.current
        pairs = [(current.key, current.cert)]
        return grpc.ssl_server_certificate_configuration(pairs, current.client_ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # grpc's hook, called before each handshake: a new configuration, or None to keep.
        try:
            self.refresh()
            if self.generation == self._grpc_generation:
                return None
            self._grpc_generation = self.generation
            return self.grpc_configuration()
        except Exception:  # an exception would escape into grpc's C core
            log.exception("TLS reload failed")
            return None

    def server_credentials(self) -> grpc.ServerCredentials:
        """gRPC credentials that pick up changed files at the next handshake."""
        return grpc.dynamic_ssl_server_credentials(
            self.grpc_configuration(), self._fetch, require_client_authentication=self.mutual
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for the HTTP side port (no client certificate asked)."""
        self.refresh()
        with self._lock:
            if self._http is None or self._http[0] != self.generation:
                try:
                    self._http = (self.generation, self._new_context())
                except (ssl.SSLError, OSError):
                    if self._http is None:
                        raise
                    log.warning("TLS files changed again while loading; HTTP keeps the old ones")
            return self._http[1]

    def _new_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._paths[0], self._paths[1], password=_no_password)
        return context

"""TLS and token-auth settings of the server: one frozen dataclass, validated at start-up.

Validation reads the files (security/tls.py, security/auth_tokens.py), so a missing or
unreadable file, a key without its certificate or a token file without tokens stops
``headrace serve`` before the model loads, with a message naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.security.auth_tokens import read_tokens
from services.security.tls import read_certificates


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: str = ""  # PEM certificate chain of the server; TLS is on when set
    tls_key: str = ""  # its PEM private key (unencrypted)
    tls_client_ca: str = ""  # PEM CA bundle: clients must present a certificate it signed
    auth_token_file: str = ""  # accepted bearer tokens, one per line; auth is on when set
    auth_reflection: bool = True  # reflection needs the token too (health never does)
    auth_metrics: bool = False  # /metrics needs the token too (/health never does)

    def __post_init__(self) -> None:
        if self.tls_key and not self.tls_cert:
            raise ValueError("--tls-key given without --tls-cert")
        if self.tls_cert and not self.tls_key:
            raise ValueError("--tls-cert given without --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.auth_metrics and not self.auth_token_file:
            raise ValueError("--auth-metrics needs --auth-token-file")
        if self.tls:
            read_certificates(self.tls_cert, self.tls_key, self.tls_client_ca or None)
        if self.auth:
            read_tokens(self.auth_token_file)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def auth(self) -> bool:
        return bool(self.auth_token_file)

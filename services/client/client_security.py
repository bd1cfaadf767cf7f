"""The bundled clients' side of TLS, mutual TLS and token auth.

``headrace generate``, ``info``, ``health`` and ``bench serve`` take the same options
(``add_flags``); ``ClientSecurity`` holds them and opens channels with them. The
token goes in every call's ``authorization: Bearer <token>`` metadata (also over
plaintext, for servers behind a private network or a mesh that encrypts).

Environment twins use ``HEADRACE_CLIENT_*`` (not the server's ``HEADRACE_TLS_*``), so
a probe running beside the server in its container never mistakes the server's
certificate for its own; the token itself may come from ``HEADRACE_AUTH_TOKEN``.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from services.security.auth_tokens import read_tokens
from services.security.tls import read_flag_file

TOKEN_ENV = "HEADRACE_AUTH_TOKEN"
_ENV = "HEADRACE_CLIENT_"
Options = Sequence[tuple[str, object]]


@dataclass(frozen=True)
class ClientSecurity:
    tls: bool = False  # TLS with the system's CAs unless ``ca`` is given
    ca: str = ""  # PEM CA bundle that signed the server's certificate
    cert: str = ""  # PEM client certificate (mutual TLS)
    key: str = ""  # its private key
    server_name: str = ""  # name to verify in the server's certificate ("" = the target host)
    token: str = ""  # bearer token sent with every call

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together (client certificate)")
        if not self.tls and (self.ca or self.cert or self.server_name):
            object.__setattr__(self, "tls", True)  # any TLS option means TLS

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ClientSecurity:
        """From the parsed ``add_flags`` options; the token from the file, else the env."""
        token = environ.get(TOKEN_ENV, "").strip()
        if args.client_auth_token_file:
            token = read_tokens(args.client_auth_token_file)[0]
        return cls(
            tls=args.client_tls,
            ca=args.client_tls_ca or "",
            cert=args.client_tls_cert or "",
            key=args.client_tls_key or "",
            server_name=args.client_tls_server_name or "",
            token=token,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every call carries: the bearer token, if any."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials (reads the files: ValueError naming the flag)."""
        ca = read_flag_file(self.ca, "--tls-ca") if self.ca else None
        key = read_flag_file(self.key, "--tls-key") if self.key else None
        cert = read_flag_file(self.cert, "--tls-cert") if self.cert else None
        return grpc.ssl_channel_credentials(ca, key, cert)

    def _options(self, options: Options) -> list[tuple[str, object]]:
        if self.server_name:
            return [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return list(options)

    def channel(self, target: str, options: Options = ()) -> grpc.Channel:
        """A blocking channel to ``target``, TLS or plaintext."""
        if not self.tls:
            return grpc.insecure_channel(target, options=self._options(options))
        return grpc.secure_channel(target, self.credentials(), options=self._options(options))

    def aio_channel(self, target: str, options: Options = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target``, TLS or plaintext."""
        if not self.tls:
            return grpc.aio.insecure_channel(target, options=self._options(options))
        return grpc.aio.secure_channel(target, self.credentials(), options=self._options(options))

    def ssl_context(self) -> ssl.SSLContext | None:
        """For HTTPS to the server's side port (/metrics), or None without TLS."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


# The TLS file/name flags: (flag, metavar, help); dest ``client_*``, env ``HEADRACE_CLIENT_*``.
_SERVER_NAME = "name the server's certificate must carry (default: the --server host)"
_TLS_FLAGS = (
    ("--tls-ca", "FILE", "PEM CA that signed the server's certificate (default: the system's)"),
    ("--tls-cert", "FILE", "PEM client certificate, for mutual TLS"),
    ("--tls-key", "FILE", "its PEM private key"),
    ("--tls-server-name", "NAME", _SERVER_NAME),
)


def add_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``--tls``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--tls-server-name``,
    ``--auth-token-file`` (dests ``client_*``, so they never set the server's config)."""
    g = parser.add_argument_group("TLS and auth (see docs/security.md)")
    tls = environ.get(_ENV + "TLS") in ("1", "true", "yes", "on")
    text = f"connect with TLS (implied by the options below) [env {_ENV}TLS]"
    g.add_argument("--tls", dest="client_tls", action="store_true", default=tls, help=text)
    for flag, metavar, text in _TLS_FLAGS:
        name = flag[2:].replace("-", "_")
        env = _ENV + name.upper()
        dest, default, text = "client_" + name, environ.get(env) or None, f"{text} [env {env}]"
        g.add_argument(flag, dest=dest, metavar=metavar, default=default, help=text)
    g.add_argument(
        "--auth-token-file",
        dest="client_auth_token_file",
        metavar="FILE",
        help="file whose first token is sent as 'authorization: Bearer <token>' "
        f"[else env {TOKEN_ENV}, the token itself]",
    )

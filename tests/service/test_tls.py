"""TLS and mutual TLS on a real in-process server, with a CA made in the test (support/certs.py).

The gRPC port and the HTTP side port share the certificate; the files are re-read when
they change (the next handshake presents the new certificate), and a broken rotation
keeps the old one. Start-up validation names the flag at fault.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization

from services.client.client import Client
from services.client.client_security import ClientSecurity
from services.gen.headrace.v1 import generation_pb2 as pb
from services.security.security_config import SecurityConfig
from services.server.server_config import ServerConfig
from tests.support.certs import Authority, Issued, issue, make_ca

TIMEOUT = 30


@dataclass(frozen=True)
class PKI:
    ca: Authority
    server: Issued
    client: Issued
    stranger: Issued  # a client certificate from another CA
    other_ca: Authority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d), make_ca(d, "other CA")
    return PKI(
        ca,
        issue(ca, d, "server"),
        issue(ca, d, "client", client=True),
        issue(other, d, "stranger", client=True),
        other,
    )


def _config(pki: PKI, mutual: bool = False, metrics_port: int = -1, **tls) -> ServerConfig:
    security = SecurityConfig(
        tls_cert=str(tls.get("cert", pki.server.cert)),
        tls_key=str(tls.get("key", pki.server.key)),
        tls_client_ca=str(pki.ca.cert) if mutual else "",
    )
    return ServerConfig(host="127.0.0.1", port=0, metrics_port=metrics_port, security=security)


def _generate(target: str, security: ClientSecurity) -> str:
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_tokens=3))
    with Client(target, TIMEOUT, security) as client:
        responses = list(client.generate(request))
    assert responses[-1].complete.usage.completion_tokens == 3
    return "".join(r.chunk.text for r in responses)


def _code(target: str, security: ClientSecurity) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _generate(target, security)
    return info.value.code()


def test_tls_call_works_and_plaintext_or_untrusted_clients_fail(serve, pki: PKI) -> None:
    running = serve(config=_config(pki))
    target = f"localhost:{running.server.port}"
    assert _generate(target, ClientSecurity(ca=str(pki.ca.cert)))
    assert _code(target, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _code(target, ClientSecurity(ca=str(pki.other_ca.cert))) == grpc.StatusCode.UNAVAILABLE
    # By IP, and with a name override the certificate does not carry.
    assert _generate(f"127.0.0.1:{running.server.port}", ClientSecurity(ca=str(pki.ca.cert)))
    wrong_name = ClientSecurity(ca=str(pki.ca.cert), server_name="elsewhere.example")
    assert _code(target, wrong_name) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(serve, pki: PKI) -> None:
    running = serve(config=_config(pki, mutual=True))
    target = f"localhost:{running.server.port}"
    ca = str(pki.ca.cert)
    assert _code(target, ClientSecurity(ca=ca)) == grpc.StatusCode.UNAVAILABLE
    stranger = ClientSecurity(ca=ca, cert=str(pki.stranger.cert), key=str(pki.stranger.key))
    assert _code(target, stranger) == grpc.StatusCode.UNAVAILABLE
    member = ClientSecurity(ca=ca, cert=str(pki.client.cert), key=str(pki.client.key))
    assert _generate(target, member)
    with Client(target, TIMEOUT, member) as client:
        assert client.health() == "SERVING"


def _https_get(url: str, ca: Path) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca))
    with urllib.request.urlopen(url, timeout=TIMEOUT, context=context) as response:
        return response.status, response.read().decode()


def test_metrics_port_speaks_https_with_the_same_certificate(serve, pki: PKI) -> None:
    running = serve(config=_config(pki, mutual=True, metrics_port=0))
    base = f"https://localhost:{running.server.metrics_port}"
    assert _https_get(base + "/health", pki.ca.cert) == (200, "SERVING\n")
    status, body = _https_get(base + "/metrics", pki.ca.cert)  # no client certificate asked
    assert status == 200 and "headrace_requests_running" in body
    with pytest.raises(OSError):  # plain HTTP to the TLS port: closed without an answer
        urllib.request.urlopen(base.replace("https", "http") + "/health", timeout=TIMEOUT)
    assert _https_get(base + "/health", pki.ca.cert)[0] == 200  # still serving after that


def _served_certificate(port: int, ca: Path) -> bytes:
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        return tls.getpeercert(binary_form=True)


def _pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def _replace(source: Path, destination: Path) -> None:
    """Swap a file in atomically, as a Kubernetes secret update or cert-manager does."""
    staging = destination.with_suffix(".new")
    shutil.copyfile(source, staging)
    os.replace(staging, destination)


def test_certificate_files_are_reloaded_on_change(serve, pki: PKI, tmp_path: Path) -> None:
    live = Issued(tmp_path / "live.crt", tmp_path / "live.key")
    _replace(pki.server.cert, live.cert)
    _replace(pki.server.key, live.key)
    running = serve(config=_config(pki, cert=live.cert, key=live.key, metrics_port=0))
    port = running.server.port
    assert _served_certificate(port, pki.ca.cert) == _pem_to_der(pki.server.cert)
    # A broken rotation (the new certificate without its key yet) keeps the old pair.
    renewed = issue(pki.other_ca, tmp_path, "renewed")
    _replace(renewed.cert, live.cert)
    assert _served_certificate(port, pki.ca.cert) == _pem_to_der(pki.server.cert)
    # The key arrives: the next handshake presents the new certificate, from the new CA.
    _replace(renewed.key, live.key)
    assert _served_certificate(port, pki.other_ca.cert) == _pem_to_der(renewed.cert)
    target = f"localhost:{port}"
    assert _generate(target, ClientSecurity(ca=str(pki.other_ca.cert)))
    assert _code(target, ClientSecurity(ca=str(pki.ca.cert))) == grpc.StatusCode.UNAVAILABLE
    metrics = f"https://localhost:{running.server.metrics_port}/health"
    assert _https_get(metrics, pki.other_ca.cert)[0] == 200


def test_start_up_validation_names_the_flag(pki: PKI, tmp_path: Path) -> None:
    cert, key = str(pki.server.cert), str(pki.server.key)
    private = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"  # must fail, not prompt for a passphrase
    encrypted.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    cases = {
        "--tls-key given without --tls-cert": {"tls_key": key},
        "--tls-cert given without --tls-key": {"tls_cert": cert},
        "--tls-client-ca (mutual TLS) needs": {"tls_client_ca": str(pki.ca.cert)},
        "--tls-cert: cannot read": {"tls_cert": str(tmp_path / "missing.crt"), "tls_key": key},
        "--tls-key: cannot read": {"tls_cert": cert, "tls_key": str(tmp_path / "missing.key")},
        "--tls-cert: ": {"tls_cert": key, "tls_key": key},  # a key where the cert should be
        "--tls-cert/--tls-key: ": {"tls_cert": cert, "tls_key": str(pki.client.key)},
        "--tls-cert/--tls-key: /": {"tls_cert": cert, "tls_key": str(encrypted)},
        "--tls-client-ca: ": {"tls_cert": cert, "tls_key": key, "tls_client_ca": key},
    }
    for expected, fields in cases.items():
        with pytest.raises(ValueError) as info:
            SecurityConfig(**fields)
        assert str(info.value).startswith(expected), (fields, str(info.value))

"""Test PKI: a CA and the server and client certificates it signs, made on the spot.

Keys are EC P-256 (fast to generate); the server certificate names localhost,
127.0.0.1 and ::1, so clients verify it on loopback without a name override.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A self-signed CA: its certificate file, and what signs with it."""

    cert: Path
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _builder(subject: x509.Name, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(path: Path, cert: x509.Certificate, key) -> Issued:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(cert_path, key_path)


def make_ca(directory: Path, common_name: str = "headrace test CA") -> Authority:
    """A self-signed CA whose certificate is written to ``directory/<common_name>.crt``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _builder(name, name, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    issued = _write(directory / common_name.replace(" ", "-"), cert, key)
    return Authority(issued.cert, name, key, cert)


def issue(
    ca: Authority,
    directory: Path,
    stem: str,
    *,
    names: tuple[str, ...] = LOOPBACK_NAMES,
    client: bool = False,
) -> Issued:
    """A leaf certificate signed by ``ca`` for ``names`` (server) or a client identity."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    cert = (
        _builder(_name(stem), ca.name, key)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return _write(directory / stem, cert, key)

"""A federation's certificate authority: `graft-fed certs init|issue|revoke`.

The operator keeps the CA; every node (and the broker) gets a certificate whose common
name IS its identity: with mutual TLS the broker takes a node's id from the certificate it
presented, never from a field the node filled in. Keys are ECDSA P-256, written 0600.

    CERTS/ca.pem, ca.key            the federation CA
    CERTS/<name>.pem, <name>.key    a node's or the broker's certificate and key
    CERTS/revoked.json              names and serials revoked (the broker also needs
                                    the name removed from its allowlist: see docs/security.md)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Sequence

from graft_fed.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:  # pragma: no cover - cryptography is a dependency
        raise ConfigError("certificate tooling needs the `cryptography` package: pip install cryptography") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def init_ca(directory: str | Path, federation: str = "graft-fed", days: int = 3650) -> Path:
    x509, hashes, serialization, ec, _, NameOID = _x509()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "ca.key").exists():
        raise ConfigError(f"{d}/ca.key exists: this folder already holds a CA (delete it to start over)")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{federation} CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(d / "ca.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d / "ca.pem"


def issue(directory: str | Path, name: str, hosts: Sequence[str] = (), days: int = 825) -> tuple[Path, Path]:
    """A certificate for node (or broker) `name`, valid as client and server; `hosts` are the
    DNS names and IP addresses a server is reached at."""
    x509, hashes, serialization, ec, EKU, NameOID = _x509()
    if not _NAME.match(name):
        raise ConfigError(f"certificate name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    d = Path(directory)
    try:
        ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{d} holds no CA: run `graft-fed certs init --dir {d}` first") from None
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list = [x509.DNSName(name)]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5)).not_valid_after(_now() + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(d / f"{name}.key", key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d / f"{name}.pem", d / f"{name}.key"


def loopback_pki(directory: str | Path, federation: str, nodes: Sequence[str]) -> Path:
    """A whole federation's certificates on one machine: a CA, the broker's certificate for
    127.0.0.1 and localhost, and one per node name (the benches, the tests). Returns the
    folder; each name's files are NAME.pem and NAME.key beside ca.pem."""
    init_ca(directory, federation)
    issue(directory, "broker", ["127.0.0.1", "localhost"])
    for name in nodes:
        issue(directory, name)
    return Path(directory)


def revoke(directory: str | Path, name: str) -> dict:
    """Record a revocation (name and serial) in CERTS/revoked.json; the broker refuses a revoked
    name at once when it is listed in its allowlist's `revoked` (graft-fed broker nodes revoke)."""
    x509, *_ = _x509()
    d = Path(directory)
    path = d / f"{name}.pem"
    if not path.is_file():
        raise ConfigError(f"no certificate {path} to revoke")
    serial = x509.load_pem_x509_certificate(path.read_bytes()).serial_number
    listing = json.loads((d / "revoked.json").read_text()) if (d / "revoked.json").is_file() else []
    entry = {"name": name, "serial": str(serial), "revoked_at": _now().isoformat()}
    listing.append(entry)
    (d / "revoked.json").write_text(json.dumps(listing, indent=2))
    return entry

"""Bundle provenance: the producing node signs what it uploads, every receiver checks it.

A bundle is addressed by the sha256 of its canonical bytes (`bundles.py`); the signature
travels *beside* it, never inside the digested bytes, so content addressing is unchanged.
The producer signs

    b"graft-fed/bundle/v1\\n" + producer node id + b"\\n" + digest (64 hex digits)

with the private key of its mutual-TLS certificate (ECDSA P-256 with SHA-256 for the keys
`graft-fed certs` issues; RSA-PSS and Ed25519 keys work too). The broker stores the
signature with the bytes, together with the certificate the node presented in the mTLS
handshake of the upload, and relays both with the bundle. A receiver accepts the bundle
only if

1. the certificate was issued by the federation CA the receiver itself trusts (its
   `tls_ca`), is within its validity period and, when the receiver has the CA's list of
   revocations (`federation.revoked_certs`, the `revoked.json` that `graft-fed certs
   revoke` writes), is not on it (whenever the bundle was signed),
2. the certificate's common name is the node the broker names as the group's source, and
3. the signature verifies with the certificate's key over (that node, the digest of the
   bytes received).

So a relaying broker cannot alter a bundle (the digest changes), pass one node's group off
as another's (the name is signed and must match the certificate), or sign with a key of
its own (it holds no certificate of the CA under a node's name).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import NameOID

from graft_fed.core.records import RecordError
from graft_fed.errors import ConfigError

CONTEXT = b"graft-fed/bundle/v1"

log = logging.getLogger("graft_fed.federation")


class ProvenanceError(RecordError):
    """A bundle whose producer cannot be established: unsigned where signatures are required,
    a signature that does not verify, or a certificate the receiver does not trust."""


def signed_message(producer: str, digest: str) -> bytes:
    return b"\n".join((CONTEXT, producer.encode("utf-8"), digest.encode("ascii")))


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _sign(key: Any, message: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(message, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(message, padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(message)
    raise ConfigError(f"cannot sign bundles with a {type(key).__name__}: use an ECDSA (graft-fed certs), RSA or "
                      "Ed25519 key")


def verify_signature(cert: x509.Certificate, producer: str, digest: str, signature: bytes) -> None:
    """Check `signature` over (producer, digest) with the certificate's public key; raises
    ProvenanceError. Checks neither the issuer nor the name: see `ProvenanceVerifier`."""
    key = cert.public_key()
    message = signed_message(producer, digest)
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, message, padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32),
                       hashes.SHA256())
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
        else:
            raise ProvenanceError(f"bundle {digest[:12]}: the signer's certificate holds a {type(key).__name__}, "
                                  "which graft-fed does not verify")
    except InvalidSignature:
        raise ProvenanceError(f"bundle {digest[:12]}: the signature does not verify for node {producer!r} "
                              "(the bytes or the signature were altered on the way)") from None


def load_certificate_der(data: bytes) -> x509.Certificate:
    try:
        cert = x509.load_der_x509_certificate(data)
        _ = (cert.subject, cert.issuer)  # names are parsed at first use: a malformed one raises ValueError here, not later
        return cert
    except ValueError as exc:
        raise ProvenanceError(f"the signer's certificate is not a DER X.509 certificate ({str(exc)[:200]})") from None


def pem_to_der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


class BundleSigner:
    """Signs this node's bundles with the key of its mTLS certificate."""

    def __init__(self, cert_path: str | Path, key_path: str | Path) -> None:
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except OSError as exc:
            raise ConfigError(f"cannot read the node's certificate or key ({exc})") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{cert_path} / {key_path}: not a PEM certificate and an unencrypted PEM private key "
                              f"({exc})") from None
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        if (key.public_key().public_bytes(serialization.Encoding.DER, pub)
                != cert.public_key().public_bytes(serialization.Encoding.DER, pub)):
            raise ConfigError(f"the key {key_path} does not belong to the certificate {cert_path}")
        _sign(key, b"probe")  # an unusable key type fails now, not at the first upload
        self._key = key
        self.name = common_name(cert)

    def sign(self, producer: str, digest: str) -> bytes:
        return _sign(self._key, signed_message(producer, digest))


class ProvenanceVerifier:
    """Checks bundle signatures against the federation CA(s) in `ca_path` (the node's own TLS
    root: the CA that issued the broker's and every node's certificate). Certificates are
    issued directly by the CA (`graft-fed certs`); intermediates are not followed."""

    def __init__(self, ca_path: str | Path, revoked_path: str | Path | None = None) -> None:
        try:
            self.roots = x509.load_pem_x509_certificates(Path(ca_path).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read the federation CA {ca_path} ({exc})") from None
        except ValueError as exc:
            raise ConfigError(f"{ca_path} holds no PEM certificate ({exc})") from None
        self._trusted: dict[bytes, x509.Certificate] = {}  # sha256 of DER -> issuer-checked certificate
        self._lock = threading.Lock()
        self.revoked_path = None if revoked_path is None else Path(revoked_path)
        self._revoked: dict[int, str] = {}  # serial -> name
        self._revoked_stamp: tuple[int, int] | None = None
        if self.revoked_path is not None:
            self._revoked, self._revoked_stamp = _read_revoked(self.revoked_path)  # a bad file stops the start

    def revoked_serials(self) -> dict[int, str]:
        """The revoked certificates (serial -> name), re-read when the file changes. A file that
        became unreadable or malformed keeps the last good list in force (logged), so a bad
        edit never lifts a revocation."""
        if self.revoked_path is None:
            return {}
        try:
            st = os.stat(self.revoked_path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError as exc:
            log.error("cannot read the revocation list %s (%s): keeping the %d revocations read before",
                      self.revoked_path, exc, len(self._revoked))
            return self._revoked
        with self._lock:
            if stamp == self._revoked_stamp:
                return self._revoked
        try:
            revoked, stamp = _read_revoked(self.revoked_path)
        except ConfigError as exc:
            log.error("%s: keeping the %d revocations read before", exc, len(self._revoked))
            return self._revoked
        with self._lock:
            self._revoked, self._revoked_stamp = revoked, stamp
        return revoked

    def _issued_by_ca(self, der: bytes) -> x509.Certificate:
        key = hashlib.sha256(der).digest()
        with self._lock:
            cert = self._trusted.get(key)
        if cert is None:
            cert = load_certificate_der(der)
            for root in self.roots:
                if cert.issuer != root.subject:
                    continue
                try:
                    cert.verify_directly_issued_by(root)
                except (ValueError, TypeError, InvalidSignature):
                    continue
                break
            else:
                raise ProvenanceError(f"the signer's certificate ({common_name(cert)!r}, issued by "
                                      f"{cert.issuer.rfc4514_string()!r}) was not issued by this node's federation CA")
            with self._lock:
                if len(self._trusted) > 4096:
                    self._trusted.clear()
                self._trusted[key] = cert
        return cert

    def verify(self, producer: str, digest: str, signature: bytes, cert_der: bytes,
               now: dt.datetime | None = None) -> str:
        """Raise ProvenanceError unless `signature` is `producer`'s over `digest`, made with
        the key of a CA-issued, currently valid certificate whose common name is `producer`.
        Returns the signer's name."""
        if not signature or not cert_der:
            raise ProvenanceError(f"bundle {digest[:12]} from {producer!r} is unsigned")
        cert = self._issued_by_ca(cert_der)
        revoked = self.revoked_serials().get(cert.serial_number)
        if revoked is not None:
            raise ProvenanceError(f"the signer's certificate ({common_name(cert)!r}, serial {cert.serial_number}) "
                                  f"was revoked (listed as {revoked!r} in {self.revoked_path})")
        now = now or dt.datetime.now(dt.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise ProvenanceError(f"the signer's certificate ({common_name(cert)!r}) is not valid now (valid "
                                  f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})")
        name = common_name(cert)
        if name != producer:
            raise ProvenanceError(f"bundle {digest[:12]} is offered as node {producer!r}'s group but is signed by "
                                  f"{name!r}")
        verify_signature(cert, producer, digest, signature)
        return name


def _read_revoked(path: Path) -> tuple[dict[int, str], tuple[int, int]]:
    """Parse a CA's revoked.json (`graft-fed certs revoke`): a list of {name, serial, ...}."""
    try:
        st = os.stat(path)
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read the revocation list {path} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(f"the revocation list {path} is not JSON ({exc}); it is the revoked.json that "
                          "`graft-fed certs revoke` writes") from None
    if not isinstance(data, list):
        raise ConfigError(f"the revocation list {path} must be a JSON list of {{name, serial}} entries")
    out: dict[int, str] = {}
    for i, entry in enumerate(data):
        try:
            serial = int(str(entry["serial"]))
            name = str(entry.get("name", ""))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ConfigError(f"the revocation list {path}, entry {i}: need {{\"name\": ..., \"serial\": "
                              f"\"<decimal serial>\"}}, got {entry!r}") from None
        out[serial] = name
    return out, (st.st_mtime_ns, st.st_size)

"""A node's own pre-flight: its certificate checked before it starts, a failed connection
explained, and a node that never joined told apart from one whose broker went away later.

With mutual TLS a broker that does not like a client certificate simply closes the
handshake; the node then only sees "UNAVAILABLE ... Socket closed" and the cause is in the
broker's log. Most causes can be seen locally first: the certificate has expired or is not
yet valid, it was issued by another CA than the one the node was given, it names another
node, or the key does not belong to it. `check_node_certificate` says which, in one line.

`explain_connect_failure` turns gRPC's connection details into the likely cause, and
`JoinTracker` / `wait_for_first_join` let a node exit non-zero with that cause when it
never managed to join (training alone after a broker outage that began later stays the
documented degraded mode).
"""

from __future__ import annotations

import datetime as dt
import socket
import time
from pathlib import Path
from typing import Callable

from graft_fed.errors import ConfigError


class NeverJoinedError(ConfigError):
    """The node could not join its broker at all; the message says the likely cause."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None


def _load_cert(path: str, what: str):
    from cryptography import x509

    data = _read(path, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        if b"PRIVATE KEY-----" in data:
            raise ConfigError(f"{what} {path} is a private key, not a certificate: are the certificate and key "
                              "swapped? (the certificate is the .pem, its key the .key)") from None
        raise ConfigError(f"{what} {path} is not a PEM certificate") from None


def _load_key(path: str, what: str):
    from cryptography.hazmat.primitives import serialization

    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        if b"BEGIN CERTIFICATE" in data:
            raise ConfigError(f"{what} {path} is a certificate, not a private key: are the certificate and key "
                              "swapped? (the certificate is the .pem, its key the .key)") from None
        raise ConfigError(f"{what} {path} is not an unencrypted PEM private key") from None


def _cn(cert) -> str | None:
    from cryptography.x509.oid import NameOID

    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def _age(delta: dt.timedelta) -> str:
    days = abs(delta.total_seconds()) / 86400
    return f"{days:.0f} days" if days >= 1 else f"{abs(delta.total_seconds()) / 3600:.1f} hours"


def check_node_certificate(node_id: str, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                           now: dt.datetime | None = None) -> None:
    """Raise ConfigError (one line) when this node's TLS files would make the broker refuse it,
    or make the node refuse the broker: expiry, issuer against `tls_ca`, name against
    `node_id`, key against certificate. Nothing to check without TLS files."""
    if not (tls_ca or tls_cert or tls_key):
        return
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("give both federation.tls_cert and federation.tls_key (mutual TLS), or neither")
    now = now or dt.datetime.now(dt.timezone.utc)
    ca = _load_cert(tls_ca, "federation.tls_ca") if tls_ca else None
    if ca is not None:
        if ca.not_valid_after_utc < now:
            raise ConfigError(f"the federation CA {tls_ca} expired {_age(now - ca.not_valid_after_utc)} ago "
                              f"({ca.not_valid_after_utc:%Y-%m-%d}); the operator must issue a new CA and certificates")
    if tls_cert is None:
        return
    cert = _load_cert(tls_cert, "federation.tls_cert")
    where = f"node {node_id!r}: certificate {tls_cert}"
    if cert.not_valid_after_utc < now:
        raise ConfigError(f"{where} expired {_age(now - cert.not_valid_after_utc)} ago "
                          f"({cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC); ask the operator for a new one "
                          f"(`graft-fed certs issue --name {node_id}`)")
    if cert.not_valid_before_utc > now:
        raise ConfigError(f"{where} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
                          f"({_age(cert.not_valid_before_utc - now)} from now): is this machine's clock right?")
    cn = _cn(cert)
    if cn != node_id:
        raise ConfigError(f"{where} is issued to {cn!r}, but federation.node_id is {node_id!r}: the broker takes a "
                          "node's identity from its certificate and would refuse every call")
    if ca is not None:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError):
            raise ConfigError(f"{where} was issued by {cert.issuer.rfc4514_string()!r}, not by the federation CA "
                              f"{tls_ca} ({ca.subject.rfc4514_string()!r}): the broker would refuse the handshake; "
                              "use the certificate and CA of this federation") from None
        except Exception:  # noqa: BLE001 - InvalidSignature: same issuer name, another key
            raise ConfigError(f"{where} carries the federation CA's name but not its signature (a CA of the same "
                              f"name, re-created?): the broker would refuse the handshake; ask for a certificate "
                              f"from the CA in {tls_ca}") from None
    key = _load_key(tls_key, "federation.tls_key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ConfigError(f"federation.tls_key {tls_key} is not the key of {tls_cert}: give the pair that "
                          "`graft-fed certs issue` wrote together")


def check_broker_certificate(tls_cert: str, tls_key: str, client_ca: str | None,
                             now: dt.datetime | None = None) -> None:
    """Raise ConfigError (one line) when the broker's own TLS files cannot serve: a file that
    is missing or not what its key says (certificate and key swapped), a key that is not the
    certificate's, an expired certificate (every node would fail its handshake). gRPC itself
    only fails to "bind" the port for the first two, which reads as a port in use."""
    now = now or dt.datetime.now(dt.timezone.utc)
    cert = _load_cert(tls_cert, "broker.tls_cert")
    key = _load_key(tls_key, "broker.tls_key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ConfigError(f"broker.tls_key {tls_key} is not the key of broker.tls_cert {tls_cert}: give the pair "
                          "that `graft-fed certs issue --name broker` wrote together")
    if cert.not_valid_after_utc < now:
        raise ConfigError(f"broker.tls_cert {tls_cert} expired {_age(now - cert.not_valid_after_utc)} ago "
                          f"({cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC): nodes would refuse every handshake; "
                          "issue a new one (`graft-fed certs issue --name broker --hosts ...`)")
    if client_ca is not None:
        _load_cert(client_ca, "broker.client_ca")


def explain_connect_failure(address: str, detail: str, tls: bool, client_cert: bool) -> str:
    """The likely cause of a failed call to the broker, from gRPC's status details."""
    d = detail.lower()
    if "connection refused" in d:
        return f"nothing listens at {address}: is the broker running, and is the port right?"
    if "not on this federation's allowlist" in d:
        return ("the broker's allowlist does not admit this certificate's name (every call, status included, needs "
                "a name on it): the operator adds it with `graft-fed broker nodes add --allowlist FILE NAME`, or "
                "use a certificate whose name is on it; a revoked name stays refused")
    if "name or service not known" in d or "dns resolution failed" in d or "could not resolve" in d:
        return f"the host of {address} cannot be resolved: check federation.broker"
    if "certificate_verify_failed" in d or "certificate verify failed" in d:
        return (f"the broker's certificate at {address} is not signed by federation.tls_ca: this node was given "
                "another federation's CA")
    if "peer name" in d and "not in peer certificate" in d:
        host = address.rsplit(":", 1)[0]
        return (f"the broker's certificate does not name {host!r}: dial it by a name it was issued for, or "
                f"reissue it with `graft-fed certs issue --name broker --hosts {host}`")
    if "wrong_version_number" in d or "wrong version number" in d:
        if _answers_http1(address):  # what the HTTP port answers to TLS, too
            return _HTTP_PORT.format(address=address)
        return (f"the broker at {address} answered in plaintext to TLS: it runs without tls_cert; drop "
                "federation.tls_* here (with insecure: true off loopback) or enable TLS on the broker")
    if "socket closed" in d or "connection reset" in d or "handshake" in d or "ssl" in d or "tls" in d:
        if not tls:
            return (f"the broker at {address} closed a plaintext connection: it most likely requires TLS; set "
                    "federation.tls_ca (and tls_cert / tls_key for mutual TLS; --tls-ca etc. for `status`)")
        if client_cert:
            return (f"the broker at {address} closed the TLS handshake: it most likely refused this node's "
                    "certificate (expired, issued by another CA, or not for this node); the broker's log has "
                    "the exact reason")
        return (f"the broker at {address} closed the TLS handshake: it most likely requires a client certificate "
                "(mutual TLS): set federation.tls_cert and tls_key (--tls-cert and --tls-key for `status`)")
    if "failed parsing http/2" in d or "http1" in d or "http/1" in d:
        return _HTTP_PORT.format(address=address)
    if "deadline" in d or "timeout" in d or "timed out" in d:
        return f"no answer from {address} in time: a firewall, a wrong address, or a broker too busy to answer"
    return "see the broker's log for the cause"


_HTTP_PORT = ("{address} answers plain HTTP/1, not gRPC: is it the broker's HTTP port (`http`, /metrics and the "
              "live page; 9464 by default) rather than its gRPC port (`listen`, 50551 by default)?")


def _answers_http1(address: str, timeout_s: float = 2.0) -> bool:
    """Whether `address` answers an HTTP/1 request (the broker's HTTP port does; its gRPC port,
    plaintext or TLS, does not). A TLS client sees both the HTTP port and a plaintext broker
    as "wrong version number"; this tells them apart."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return conn.recv(5) == b"HTTP/"
    except (OSError, ValueError):
        return False


class JoinTracker:
    """Whether a node ever joined, and the last failure if not."""

    def __init__(self, address: str, node_id: str, tls: bool, client_cert: bool) -> None:
        self.address, self.node_id, self.tls, self.client_cert = address, node_id, tls, client_cert
        self.ever_joined = False
        self.attempts = 0
        self.last_error: str = ""

    def joined(self) -> None:
        self.ever_joined = True

    def failed(self, exc: BaseException) -> None:
        self.attempts += 1
        status = getattr(exc, "status", "")
        self.last_error = f"{status} {exc}".strip()

    def error(self, waited_s: float | None = None) -> NeverJoinedError:
        cause = explain_connect_failure(self.address, self.last_error, self.tls, self.client_cert)
        waited = f" in {waited_s:.0f} s" if waited_s is not None else ""
        return NeverJoinedError(f"node {self.node_id!r} never joined the broker at {self.address} "
                                f"({self.attempts} attempt(s){waited}): {cause} [{self.last_error or 'no answer'}]")


def wait_for_first_join(try_join: Callable[[], bool], tracker: JoinTracker, timeout_s: float,
                        poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep) -> None:
    """Call `try_join` until it returns True (then mark the tracker joined) or `timeout_s`
    passes (then raise the tracker's NeverJoinedError). A broker that starts a little after
    the node (compose, Kubernetes) is waited for; one that never answers is an error."""
    start = clock()
    while True:
        if try_join():
            tracker.joined()
            return
        if clock() - start >= timeout_s:
            raise tracker.error(clock() - start)
        sleep(poll_s)


def track_joins(client: object, tracker: JoinTracker) -> None:
    """Record every Join of `client` (a BrokerClient) in `tracker`: wraps its `join` so that a
    failure is remembered (and still raised) and a success marks the tracker joined."""
    inner = client.join  # type: ignore[attr-defined]

    def join(*args, **kwargs):
        try:
            out = inner(*args, **kwargs)
        except Exception as exc:
            tracker.failed(exc)
            raise
        tracker.joined()
        return out

    client.join = join  # type: ignore[attr-defined]

"""Transport security shared by broker and node: TLS by default off loopback, plaintext
only on loopback or with an explicit `insecure` that warns at every start."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import grpc

from graft_fed.errors import ConfigError

log = logging.getLogger("graft_fed.transport")


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_pem(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


def check_plaintext(address: str, insecure: bool, who: str) -> None:
    """Refuse plaintext off loopback unless explicitly allowed; warn every time it is."""
    if is_loopback(address):
        return
    if not insecure:
        raise ConfigError(f"{who} would use plaintext gRPC on {address}, which is not a loopback address: "
                          "give TLS files (see docs/security.md), or set insecure: true if the network is "
                          "trusted (it will be logged as a warning at every start)")
    log.warning("%s: INSECURE plaintext gRPC on %s; anyone on the path can read and alter the traffic", who,
                address)


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS; with `client_ca`, mutual TLS: clients must present a certificate signed by it."""
    pair = (read_pem(key, "TLS key"), read_pem(cert, "TLS certificate"))
    ca = read_pem(client_ca, "client CA")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    if (cert is None) != (key is None):
        raise ConfigError("give both tls_cert and tls_key (the node's certificate for mutual TLS), or neither")
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "CA certificate"),
                                        private_key=read_pem(key, "TLS key"),
                                        certificate_chain=read_pem(cert, "TLS certificate"))


def grpc_options(max_message_mib: int) -> list[tuple[str, int]]:
    """Message limits set explicitly (both directions) and keepalive under 4 minutes, shared
    by server and client so the two sides agree."""
    limit = max_message_mib * 2**20
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
    ]


#: Request metadata key a client sends to ask the broker how long its call took inside the
#: broker; the answer comes back in the trailing metadata under the same key:
#: "PICKED,ENTERED,LEFT", Unix times in nanoseconds of the broker's clock: when grpcio's
#: serving thread took the call, when a worker thread entered the handler chain, and when
#: the handler returned. A diagnostic (bench/broker/load.py reads it); unary calls only.
TIMING_KEY = "graft-timing"


def parse_timing(trailing_metadata: object) -> tuple[float, float, float] | None:
    """(picked, entered, left) in Unix seconds from a call's trailing metadata, None when the
    broker sent no timing (it predates TIMING_KEY, or the call failed)."""
    for key, value in trailing_metadata or ():
        if key == TIMING_KEY:
            try:
                picked, entered, left = (int(x) / 1e9 for x in str(value).split(","))
            except ValueError:
                return None
            return picked, entered, left
    return None

"""Authentication and authorisation, as a server interceptor.

With mutual TLS a node's identity is the common name of the certificate it presented;
every request that names a node must name that one (a node can publish, fetch and report
only as itself). The operator's allowlist (a YAML file, re-read when it changes) says who
may take part; a name moved to `revoked` is refused at its very next call, heartbeats
included, so a revoked node cannot be revived by a late heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import grpc
import yaml

from graft_fed.errors import ConfigError
from graft_fed.federation.errors import FederationError, PermissionDenied, ResourceExhausted, Unauthenticated
from graft_fed.federation.limits import clip
from graft_fed.federation.status import to_status

log = logging.getLogger("graft_fed.broker")


class Allowlist:
    """`{allowed: [names], revoked: [names], trusted: [names]}`; an empty or missing `allowed`
    admits every name that is not revoked; `trusted` names are exempt from automatic
    quarantine (the operator's reversal of it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self.allowed: set[str] = set()
        self.revoked: set[str] = set()
        self.trusted: set[str] = set()
        self._load()

    def _load(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            raise ConfigError(f"allowlist {self.path} does not exist; create it with "
                              "`graft-fed broker nodes add --allowlist FILE NAME`") from None
        if mtime == self._mtime:
            return
        try:
            data = yaml.safe_load(self.path.read_text(encoding="utf-8")) or {}
            allowed = set(map(str, data.get("allowed") or []))
            revoked = set(map(str, data.get("revoked") or []))
            trusted = set(map(str, data.get("trusted") or []))
        except (yaml.YAMLError, AttributeError, TypeError) as exc:
            log.error("allowlist %s is malformed (%s); keeping the previous one", self.path, exc)
            return
        self.allowed, self.revoked, self.trusted, self._mtime = allowed, revoked, trusted, mtime

    def permits(self, node_id: str) -> bool:
        with self._lock:
            self._load()
            return node_id not in self.revoked and (not self.allowed or node_id in self.allowed)

    def is_revoked(self, node_id: str) -> bool:
        with self._lock:
            self._load()
            return node_id in self.revoked

    def is_trusted(self, node_id: str) -> bool:
        with self._lock:
            self._load()
            return node_id in self.trusted

    @staticmethod
    def edit(path: str | Path, action: str, name: str | None = None) -> dict[str, list[str]]:
        path = Path(path)
        data = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
        allowed, revoked = set(data.get("allowed") or []), set(data.get("revoked") or [])
        trusted = set(data.get("trusted") or [])
        if action == "add" and name:
            allowed.add(name)
            revoked.discard(name)
        elif action == "revoke" and name:
            revoked.add(name)
            allowed.discard(name)
            trusted.discard(name)
        elif action == "release" and name:
            trusted.add(name)
        out = {"allowed": sorted(allowed), "revoked": sorted(revoked), "trusted": sorted(trusted)}
        if action != "list":
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(yaml.safe_dump(out), encoding="utf-8")
            tmp.replace(path)
        return out


def _peer_name(context: grpc.ServicerContext) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


class IdentityInterceptor(grpc.ServerInterceptor):
    """Runs before every handler. Under mutual TLS the caller is the certificate's common
    name: it must be permitted by the allowlist (every RPC, GetStatus and requests that do
    not even parse included), and a request naming a node must name that one. Without
    mutual TLS, a request naming a node must name a permitted one.

    Refusals are domain errors: a unary call is aborted with their status here; inside an
    upload's stream they are raised into the handler, whose error mapping answers them
    (PERMISSION_DENIED or UNAUTHENTICATED, never INTERNAL). Every refusal is counted and
    logged by `refusals` (a graft_fed.broker.live.RefusalLog) when one is given."""

    def __init__(self, require_certificate: bool, allowlist: Allowlist | None,
                 max_requests_per_s: float = 0.0, refusals: Any = None) -> None:
        self.require_certificate = require_certificate
        self.allowlist = allowlist
        self.rate = max_requests_per_s
        self.refusals = refusals
        self._buckets: dict[str, tuple[float, float]] = {}  # certificate name -> (tokens, last refill)
        self._bucket_lock = threading.Lock()

    def _refuse(self, reason: str, identity: str, exc: FederationError) -> NoReturn:
        if self.refusals is not None:
            self.refusals.refused(reason, identity, str(exc))
        raise exc

    def _why(self, name: str) -> str:
        assert self.allowlist is not None
        return "revoked" if self.allowlist.is_revoked(name) else "not_allowed"

    def admit(self, context: grpc.ServicerContext) -> None:
        """Per-certificate request rate limit (a token bucket with a burst of 4x the rate):
        ResourceExhausted beyond. Only under mutual TLS, where the name is proven: without it
        a limit keyed on a claimed name would let anyone exhaust an honest node's budget."""
        if not self.rate or not self.require_certificate:
            return
        peer = _peer_name(context)
        if peer is None:
            return
        now = time.monotonic()
        with self._bucket_lock:
            tokens, last = self._buckets.get(peer, (4 * self.rate, now))
            tokens = min(4 * self.rate, tokens + (now - last) * self.rate)
            if tokens < 1:
                self._buckets[peer] = (tokens, now)
                raise ResourceExhausted(f"{clip(peer)} sends more than {self.rate:g} requests per second; slow down")
            self._buckets[peer] = (tokens - 1, now)

    def check(self, node_id: str, context: grpc.ServicerContext) -> None:
        """Raise Unauthenticated or PermissionDenied unless the caller may act as `node_id`
        ("" for a request that names no node)."""
        if self.require_certificate:
            peer = _peer_name(context)
            if peer is None:
                self._refuse("no_client_certificate", node_id,
                             Unauthenticated("no client certificate: this broker requires mutual TLS"))
            if self.allowlist is not None and not self.allowlist.permits(peer):
                self._refuse(self._why(peer), peer,
                             PermissionDenied(f"the client certificate's holder {clip(peer)} is not on this "
                                              "federation's allowlist (or was revoked)"))
            if node_id and node_id != peer:
                self._refuse("identity_mismatch", peer,
                             PermissionDenied(f"the client certificate is for {clip(peer)}; it cannot act as node "
                                              f"{clip(node_id)}"))
        if node_id and self.allowlist is not None and not self.allowlist.permits(node_id):
            self._refuse(self._why(node_id), node_id,
                         PermissionDenied(f"node {clip(node_id)} is not on this federation's allowlist (or was "
                                          "revoked)"))

    def _abort_unless_permitted(self, request: Any, context: grpc.ServicerContext) -> None:
        try:
            self.check(getattr(request, "node_id", ""), context)
            self.admit(context)
        except FederationError as exc:
            context.abort(*to_status(exc))

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        check, guard = self.check, self._abort_unless_permitted

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                guard(request, context)
                return inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                guard(request, context)
                return inner_us(request, context)
            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            def stream_unary(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
                try:
                    self.admit(context)
                except FederationError as exc:
                    context.abort(*to_status(exc))

                def checked() -> Iterator[Any]:
                    for msg in request_iterator:
                        check(getattr(msg, "node_id", ""), context)  # raised into the handler's loop
                        yield msg
                return inner_su(checked(), context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler

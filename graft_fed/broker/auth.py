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
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import yaml

from graft_fed.errors import ConfigError

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
    def __init__(self, require_certificate: bool, allowlist: Allowlist | None, refusals: Any = None) -> None:
        """`refusals`: a graft_fed.broker.live.RefusalLog that counts (and logs) every refusal."""
        self.require_certificate = require_certificate
        self.allowlist = allowlist
        self.refusals = refusals

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, reason: str, identity: str,
                message: str) -> None:
        if self.refusals is not None:
            self.refusals.refused(reason, identity, message)
        context.abort(code, message)

    def _check(self, node_id: str, context: grpc.ServicerContext) -> None:
        if self.require_certificate:
            peer = _peer_name(context)
            if peer is None:
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "no_client_certificate", node_id,
                             "no client certificate: this broker requires mutual TLS")
            if node_id and node_id != peer:
                self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "identity_mismatch", str(peer),
                             f"the client certificate is for {peer!r}; it cannot act as node {node_id!r}")
        if node_id and self.allowlist is not None and not self.allowlist.permits(node_id):
            revoked = self.allowlist.is_revoked(node_id)
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "revoked" if revoked else "not_allowed", node_id,
                         f"node {node_id!r} " + ("was revoked by this federation's operator" if revoked
                                                 else "is not on this federation's allowlist"))

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        check = self._check

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                check(getattr(request, "node_id", ""), context)
                return inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                check(getattr(request, "node_id", ""), context)
                return inner_us(request, context)
            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            def stream_unary(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
                def checked() -> Iterator[Any]:
                    for msg in request_iterator:
                        check(getattr(msg, "node_id", ""), context)
                        yield msg
                return inner_su(checked(), context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler

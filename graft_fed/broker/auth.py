"""Authentication and authorisation, as a server interceptor.

With mutual TLS a node's identity is the common name of the certificate it presented;
every request that names a node must name that one (a node can publish, fetch and report
only as itself). The operator's allowlist (a YAML file, re-read when it changes) says who
may take part; a name moved to `revoked` is refused at its very next call, heartbeats
included, so a revoked node cannot be revived by a late heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import grpc
import yaml

from graft_fed.configbase import utf8_text
from graft_fed.errors import ConfigError
from graft_fed.federation.errors import FederationError, PermissionDenied, ResourceExhausted, Unauthenticated
from graft_fed.federation.limits import clip
from graft_fed.federation.status import to_status
from graft_fed.fslock import LockUnsupported, hold_exclusive

log = logging.getLogger("graft_fed.broker")


ALLOWLIST_KEYS = ("allowed", "revoked", "trusted")
_STR = "tag:yaml.org,2002:str"
_NULL = "tag:yaml.org,2002:null"
_KINDS = {"tag:yaml.org,2002:int": "a number", "tag:yaml.org,2002:float": "a number",
          "tag:yaml.org,2002:bool": "a yes/no value", "tag:yaml.org,2002:null": "empty",
          "tag:yaml.org,2002:timestamp": "a date"}


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    where = f" ({context}, line {cmark.line + 1})" if context and cmark is not None else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{where}"


def parse_allowlist(raw: bytes, path: str | Path) -> dict[str, list[str]]:
    """The allowlist file's bytes as `{allowed, revoked, trusted: sorted names}`, or a
    ConfigError that names the file, the key and what to write instead. Nothing is coerced:
    a key's value must be a list of names (strings) or empty; `revoked: mallory` (one name,
    not a list), `allowed: [alice, 007]` (YAML reads 007 as a number), a top level that is a
    list, an unknown or repeated key are refused rather than guessed at (a guess could admit
    a name the operator meant to refuse). An empty file is an empty allowlist."""
    where = f"allowlist {path}"
    text = utf8_text(raw, where, encoding="utf-8-sig")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML ({_yaml_problem(exc)}); fix it, or rewrite it with "
                          "`graft-fed broker nodes add|revoke --allowlist FILE NAME`") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply to be an allowlist; write `allowed: [name, ...]`") from None
    out: dict[str, list[str]] = {k: [] for k in ALLOWLIST_KEYS}
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == _NULL):
        return out
    if not isinstance(root, yaml.MappingNode):
        what = "a list" if isinstance(root, yaml.SequenceNode) else f"the single value {root.value!r}"
        raise ConfigError(f"{where}: the top level is {what}, not a mapping; write the names under their key, "
                          "e.g. `allowed: [alice, bob]` and `revoked: [mallory]`")
    seen: dict[str, int] = {}
    for key_node, value in root.value:
        line = key_node.start_mark.line + 1
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STR else None
        if key not in ALLOWLIST_KEYS:
            shown = repr(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "(a list or mapping)"
            raise ConfigError(f"{where}, line {line}: unknown key {shown}; the keys are "
                              f"{', '.join(ALLOWLIST_KEYS)} (a misspelt `revoked` would revoke no one)")
        if key in seen:
            raise ConfigError(f"{where}: `{key}` appears twice (lines {seen[key]} and {line}); YAML would keep only "
                              "the second; merge them into one list")
        seen[key] = line
        if isinstance(value, yaml.ScalarNode) and value.tag == _NULL:
            continue  # `revoked:` with nothing after it: no names
        if not isinstance(value, yaml.SequenceNode):
            if isinstance(value, yaml.ScalarNode):
                fix = f"`{key}: [{value.value}]`" if value.value else f"`{key}: []`"
                raise ConfigError(f"{where}, line {value.start_mark.line + 1}: `{key}` is the single value "
                                  f"{value.value!r}, not a list of names; write {fix} (or one `- NAME` line per "
                                  "name below it)")
            raise ConfigError(f"{where}, line {value.start_mark.line + 1}: `{key}` is a mapping, not a list of "
                              f"names; write `{key}: [name, ...]`")
        names = []
        for i, item in enumerate(value.value, 1):
            at = f"{where}, line {item.start_mark.line + 1}: entry {i} of `{key}`"
            if not isinstance(item, yaml.ScalarNode):
                kind = "a list" if isinstance(item, yaml.SequenceNode) else "a mapping"
                raise ConfigError(f"{at} is {kind}, not a name; write one name per entry")
            if item.tag != _STR:
                if item.tag == _NULL:
                    raise ConfigError(f"{at} is empty; remove it or write the name")
                kind = _KINDS.get(item.tag, f"a value tagged {item.tag}")
                raise ConfigError(f"{at}, {item.value!r}, is read by YAML as {kind}, not a name; quote it: "
                                  f"{_quoted(item.value)}")
            if not item.value:
                raise ConfigError(f"{at} is an empty name; remove it")
            names.append(item.value)
        out[key] = sorted(set(names))
    return out


def _version(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class Allowlist:
    """`{allowed: [names], revoked: [names], trusted: [names]}`; an empty or missing `allowed`
    admits every name that is not revoked; `trusted` names are exempt from automatic
    quarantine (the operator's reversal of it).

    Read at start, where a missing, unreadable or malformed file is a ConfigError (the broker
    does not start). Then re-read when the file changes (another inode, mtime or size): each
    version is parsed once. While serving, a version that cannot be used (missing, e.g.
    while an editor replaces it; unreadable; not UTF-8; malformed; or emptied to 0 bytes,
    which is what an in-place rewrite shows before its first write) leaves the last good
    list in force, with one warning per version that says what is wrong; the next good
    version takes effect at the next call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        #: (device, inode, mtime_ns, size) of the version last read, good or not; "missing"
        self._version: tuple[int, int, int, int] | str | None = None
        self.allowed: set[str] = set()
        self.revoked: set[str] = set()
        self.trusted: set[str] = set()
        #: what is wrong with the file while the last good list stays in force (None: nothing)
        self.problem: str | None = None
        try:
            version, raw = self._read()
        except FileNotFoundError:
            raise ConfigError(f"allowlist {self.path} does not exist; create it with "
                              "`graft-fed broker nodes add --allowlist FILE NAME`") from None
        except OSError as exc:
            raise ConfigError(f"allowlist {self.path} cannot be read ({exc.strerror or exc}); make it readable "
                              "by the broker") from None
        self._apply(parse_allowlist(raw, self.path))
        self._version = version  # None when it changed while read: read again at the first call

    def _read(self) -> tuple[tuple[int, int, int, int] | None, bytes]:
        """The file's version and bytes; the version is None when the file changed while it was read."""
        with open(self.path, "rb") as f:
            before = _version(os.fstat(f.fileno()))
            raw = f.read()
            after = _version(os.fstat(f.fileno()))
        return (before if before == after else None), raw

    def _apply(self, data: dict[str, list[str]]) -> None:
        self.allowed, self.revoked, self.trusted = set(data["allowed"]), set(data["revoked"]), set(data["trusted"])

    def _keep(self, problem: str) -> None:
        self.problem = problem
        log.warning("%s; the last good allowlist stays in force (%d allowed, %d revoked, %d trusted) until the file "
                    "is fixed", problem, len(self.allowed), len(self.revoked), len(self.trusted))

    def _load(self) -> None:
        """Re-read the file if it changed; never raises (see the class)."""
        try:
            version: tuple[int, int, int, int] | str = _version(os.stat(self.path))
        except FileNotFoundError:
            version = "missing"
        except OSError as exc:
            version = f"stat failed: {exc.strerror or exc}"
        if version == self._version:
            return
        if isinstance(version, str):
            self._version = version
            if version == "missing":
                self._keep(f"allowlist {self.path} does not exist (deleted, or moved away by an editor); restore it, "
                           "or recreate it with `graft-fed broker nodes add --allowlist FILE NAME`")
            else:
                self._keep(f"allowlist {self.path} cannot be read ({version}); make it readable by the broker")
            return
        try:
            read, raw = self._read()
        except FileNotFoundError:
            return  # gone between stat and open: the next call sees it missing
        except OSError as exc:
            self._version = version
            self._keep(f"allowlist {self.path} cannot be read ({exc.strerror or exc}); make it readable by the broker")
            return
        if read is None:
            return  # being written: read it again at the next call
        self._version = read
        if not raw and (self.allowed or self.revoked or self.trusted):
            self._keep(f"allowlist {self.path} is empty (0 bytes), as a file being rewritten in place is before its "
                       "first write; to admit every node that is not revoked write `allowed: []` in it")
            return
        try:
            data = parse_allowlist(raw, self.path)
        except ConfigError as exc:
            self._keep(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a call must never fail for the file's sake
            self._keep(f"allowlist {self.path} could not be parsed ({type(exc).__name__}: {exc})")
            return
        self._apply(data)
        if self.problem is not None:
            log.warning("allowlist %s is valid again: %d allowed, %d revoked, %d trusted", self.path,
                        len(self.allowed), len(self.revoked), len(self.trusted))
            self.problem = None

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

    def current_problem(self) -> str | None:
        """What is wrong with the file now (the last good list is in force meanwhile), after
        reading it again if it changed; None when the list in force is the file's."""
        with self._lock:
            self._load()
            return self.problem

    @staticmethod
    def edit(path: str | Path, action: str, name: str | None = None) -> dict[str, list[str]]:
        """Apply `action` (add, revoke, release, list) to the file and return its lists. A file
        that is not a valid allowlist is a ConfigError and is left as it is; the new version is
        written beside it and renamed over it (the broker never reads a half-written file)."""
        path = Path(path)
        if action == "list":
            return Allowlist._edit_locked(path, action, name)
        # two `broker nodes` commands at once: each reads, changes and writes the whole file,
        # so without a lock one could write over the other's revocation. The lock is the
        # folder's (flock on the directory): nothing is left beside the file
        try:
            folder: int | None = hold_exclusive(path.parent, wait=True)
        except LockUnsupported as exc:  # a network share without flock: edit as before, unlocked
            log.warning("cannot lock the folder of allowlist %s (%s): run one `broker nodes` command at a time there",
                        path, exc.strerror or exc)
            folder = None
        except OSError as exc:
            raise ConfigError(f"cannot open the folder of allowlist {path} ({exc.strerror or exc})") from None
        try:
            return Allowlist._edit_locked(path, action, name)
        finally:
            if folder is not None:
                os.close(folder)  # and with it the lock

    @staticmethod
    def _edit_locked(path: Path, action: str, name: str | None) -> dict[str, list[str]]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = b""
        except IsADirectoryError:
            raise ConfigError(f"allowlist {path} is a directory; give the allowlist file's path") from None
        except OSError as exc:
            raise ConfigError(f"allowlist {path} cannot be read ({exc.strerror or exc})") from None
        data = parse_allowlist(raw, path)
        allowed, revoked, trusted = set(data["allowed"]), set(data["revoked"]), set(data["trusted"])
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
            _write_atomically(path, yaml.safe_dump(out).encode("utf-8"))
        return out


def _write_atomically(path: Path, raw: bytes) -> None:
    """Write `raw` to a temporary file in `path`'s folder (with the old file's permissions,
    flushed to disk) and rename it over `path`; on any failure `path` is left as it was."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ConfigError(f"cannot write the allowlist beside {path} ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the allowlist {path} ({exc.strerror or exc}); it was left as it was") from None


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

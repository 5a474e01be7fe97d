"""Operator requests to a running broker, as files: what `graft-fed broker forget-secret`
does while the broker holds its state (the command cannot open the state then; before,
the operator had to stop the broker, and a federation of a thousand nodes with it, to give
one node its id back).

The requests directory is `<db>-requests/`, beside the state's bundles and blocks
directories, made 0700 by the broker (an existing one is tightened to 0700, and one owned by
another user is not served): whoever can write there could edit the state itself. A request
is `<id>.request`, JSON `{"action": "forget_secret", "node_id": ..., "options": {...}}` (the
options, strings, are the action's: `hold_for` for forget_secret), written to a temporary
name and renamed, so the broker never reads half of one. The id is when the request was
left (nanoseconds), then random: requests are applied in the order of their names, so in
the order they were left. The broker's housekeeping takes the requests each second: it
claims each (renames it to a hidden name, so it is applied once even when its answer cannot
be written), reads it only as a regular file of this user or root (never through a link,
never waiting on a pipe), applies it, writes its answer as `<id>.answer` (`{"ok": ...,
"message": ..., "options": [the options applied]}`, written to a new temporary file, never
through a link, then renamed) and deletes it; the command waits for the answer, prints it
and deletes it. A request that is not one (not JSON, an unknown action or option, a node id
that is not a string) is answered with what was wrong, never applied; answers nobody
collected and leftovers of failed writes are deleted after an hour. With the broker
stopped, the command applies the requests still waiting, in order, before its own
(`Spool.serve` on the state it opens): left there, the broker would apply them after it at
its next start.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Callable, Mapping

from graft_fed.broker.blockfiles import LOCK_NAME
from graft_fed.errors import GraftFedError
from graft_fed.federation.limits import MAX_STRING_LEN
from graft_fed.fslock import LockHeld, hold_exclusive

log = logging.getLogger("graft_fed.broker")

MAX_REQUEST_BYTES = 64 * 1024
MAX_OPTIONS = 8
ANSWERS_KEPT_S = 3600.0


def requests_dir(db: str | Path) -> Path:
    return Path(f"{db}-requests")


def broker_running(db: str | Path) -> bool:
    """Whether a broker holds the state `db` now (the lock its SqliteState takes, in the
    blocks directory: broker/blockfiles.py)."""
    try:
        fd = hold_exclusive(os.path.join(f"{db}-blocks", LOCK_NAME), lock_file=True)
    except LockHeld:
        return True
    except OSError:  # no blocks directory (a state never opened by this version): no broker holds it
        return False
    os.close(fd)
    return False


def _write_atomic(path: Path, payload: dict, owner: tuple[int, int] | None = None) -> None:
    """Write `payload` as JSON to a new temporary file beside `path` (never opened through a
    link someone left under its name; given to `owner`, (uid, gid), when set), then rename it
    to `path` (which replaces a link there rather than following it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        os.unlink(tmp)  # a leftover, or a link planted under the name: the link goes, not its target
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        if owner is not None:
            os.fchown(fh.fileno(), *owner)
        json.dump(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def submit(db: str | Path, action: str, node_id: str, options: Mapping[str, str] | None = None) -> Path:
    """Leave a request for the broker running on state `db`; the path its answer will have."""
    folder = requests_dir(db)
    if not folder.is_dir():
        raise GraftFedError(f"{folder} does not exist: the broker of {db} makes it at start (this broker's version "
                            "predates live requests, or it could not make the folder: its log says so); stop the "
                            "broker to run the command")
    # named by when it was left, then at random: the broker applies requests in name order,
    # so a later request is applied after an earlier one that waited (a hold is not undone
    # by a plain forget left before it)
    rid = f"{time.time_ns():020d}-{secrets.token_hex(8)}"
    st = folder.stat()
    # run as root for a broker of its own user (`docker exec` as root, sudo): the request
    # (0600) is given to the broker's user, who could not read it otherwise
    owner = (st.st_uid, st.st_gid) if os.geteuid() == 0 and st.st_uid != 0 else None
    try:
        _write_atomic(folder / f"{rid}.request", {"action": action, "node_id": node_id, "options": dict(options or {})},
                      owner)
    except OSError as exc:
        raise GraftFedError(f"cannot leave a request in {folder} ({exc}): run the command as the broker's user") \
            from None
    return folder / f"{rid}.answer"


def await_answer(answer: Path, wait_s: float, poll_s: float = 0.1) -> dict | None:
    """The broker's answer (then deleted), or None when none came within `wait_s`."""
    end = time.monotonic() + wait_s
    while True:
        try:
            with open(answer, encoding="utf-8") as fh:
                got = json.load(fh)
        except FileNotFoundError:
            got = None
        except (OSError, ValueError) as exc:
            raise GraftFedError(f"the broker's answer {answer} cannot be read: {exc}") from None
        if got is not None:
            answer.unlink(missing_ok=True)
            return got if isinstance(got, dict) else {"ok": False, "message": f"a malformed answer: {got!r}"}
        if time.monotonic() >= end:
            return None
        time.sleep(poll_s)


class Spool:
    """The broker's side: make the directory, then `serve` it (housekeeping, each second)."""

    def __init__(self, db: str | Path, actions: Mapping[str, Callable[[str, Mapping[str, str]], str]]) -> None:
        """`actions[action](node_id, options)` does one request and returns what it did, in
        words; it raises GraftFedError (or ValueError) for one it refuses (an option it does
        not take included). Raises OSError where the folder cannot be made, and GraftFedError
        where it is not this user's to serve."""
        self.path = requests_dir(db)
        self.actions = dict(actions)
        self.path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise GraftFedError(f"{self.path} is not a folder (a link?): operators' requests are not taken")
        if st.st_uid != os.geteuid():
            raise GraftFedError(f"{self.path} belongs to user {st.st_uid}, not to the broker's ({os.geteuid()}): "
                                "operators' requests are not taken (remove the folder; the broker makes its own)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("%s could be read or written by others (mode %o): made 0700", self.path,
                        stat.S_IMODE(st.st_mode))
            os.chmod(self.path, 0o700)

    def serve(self, now: float | None = None) -> int:
        """Apply every waiting request and answer it; returns how many were answered."""
        now = time.time() if now is None else now
        answered = 0
        try:
            names = sorted(os.listdir(self.path))
        except OSError as exc:
            log.warning("operator requests %s cannot be listed: %s", self.path, exc)
            return 0
        for name in names:
            path = self.path / name
            if name.endswith(".answer") or name.startswith("."):  # uncollected answers, claims, leftovers
                self._drop_if_old(path, now)
                continue
            if not name.endswith(".request"):
                continue
            rid = name[:-len(".request")]
            claimed = self.path / f".{rid}.claimed"
            try:  # claimed before it is applied: applied once, even when its answer cannot be written
                os.rename(path, claimed)
            except OSError as exc:
                log.error("operator request %s cannot be claimed (%s): not applied", name, exc)
                continue
            reply = self._one(claimed, name)
            try:
                _write_atomic(self.path / f"{rid}.answer", reply)
            except OSError as exc:
                log.error("operator request %s: its answer cannot be written (%s); it was %s", name, exc,
                          "applied" if reply.get("ok") else "not applied")
            self._remove(claimed)
            answered += 1
        return answered

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:  # a folder with something in it: left, as any file that is not ours to delete
            pass

    def _drop_if_old(self, path: Path, now: float) -> None:
        try:
            if now - os.lstat(path).st_mtime > ANSWERS_KEPT_S:
                self._remove(path)
        except OSError:
            pass

    def _read(self, path: Path) -> bytes:
        """A request's bytes: a regular file of this user or root, opened without following a
        link and without waiting (a pipe would hold the housekeeping)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise ValueError(f"not a file that can be read ({exc.strerror or exc})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_uid not in (os.geteuid(), 0):
                raise ValueError(f"written by user {st.st_uid}, neither the broker's nor root")
            data = b""
            while len(data) <= MAX_REQUEST_BYTES:
                piece = os.read(fd, MAX_REQUEST_BYTES + 1 - len(data))
                if not piece:
                    break
                data += piece
        finally:
            os.close(fd)
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"more than {MAX_REQUEST_BYTES} bytes")
        return data

    def _one(self, path: Path, name: str) -> dict:
        try:
            req = json.loads(self._read(path).decode("utf-8"))
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
            action, node_id = req.get("action"), req.get("node_id")
            if not isinstance(action, str) or action not in self.actions:
                raise ValueError(f"unknown action {str(action)[:80]!r} (one of {', '.join(self.actions)})")
            if not isinstance(node_id, str) or not node_id or len(node_id) > MAX_STRING_LEN:
                raise ValueError(f"node_id must be a non-empty string of at most {MAX_STRING_LEN} characters")
            options = req.get("options", {})
            if not isinstance(options, dict) or len(options) > MAX_OPTIONS or not all(
                    isinstance(v, str) and len(v) <= MAX_STRING_LEN for v in options.values()):
                raise ValueError(f"options must be an object of at most {MAX_OPTIONS} strings of at most "
                                 f"{MAX_STRING_LEN} characters")
        except (OSError, ValueError) as exc:
            log.warning("operator request %s refused: %s", name, exc)
            return {"ok": False, "message": f"request refused: {exc}"}
        try:
            message = self.actions[action](node_id, options)
        except (GraftFedError, ValueError) as exc:
            log.warning("operator request %s (%s %r) refused: %s", name, action, node_id, exc)
            return {"ok": False, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a failing request must not stop the housekeeping
            log.exception("operator request %s (%s %r) failed", name, action, node_id)
            return {"ok": False, "message": f"the broker failed to apply it: {exc} (its log says more)"}
        log.warning("operator request %s: %s", name, message)
        # the options applied: a command that gave one can tell a broker that took it from
        # one of an older version, which would ignore it
        return {"ok": True, "message": message, "options": sorted(options)}

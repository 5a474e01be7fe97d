"""The node's secret: random, made at the node's first start and kept in its run folder
(`<run.output_dir>/node_secret`, mode 0600). Every Join carries it; the broker keeps its hash,
and the node id is then held by whoever brings the same secret (broker/sessions.py): another
participant cannot take the id over by joining under it. Under mutual TLS the certificate
proves who calls, and the secret only follows it.

A resumed node finds the secret in its folder and joins as itself. A new run in another
folder under the same `federation.node_id` brings another secret and is refused: it needs a
node id of its own, the old folder's `node_secret` file (the same node moved), or the broker's
operator holding the id for its new secret (`graft-fed node --print-secret-hash` prints the
hash to give them; `graft-fed broker forget-secret --hold-for`)."""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

from graft_fed.errors import ConfigError

FILE_NAME = "node_secret"
_HEX = set(string.hexdigits.lower())


def load_or_create(folder: str | Path) -> str:
    """The secret kept in `folder`, made (and written durably, 0600) when there is none."""
    path = Path(folder) / FILE_NAME
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return _create(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read this node's secret {path}: {exc}") from None
    if len(text) != 64 or not _HEX.issuperset(text):
        raise ConfigError(f"{path} is not a node secret (64 hexadecimal digits, as graft-fed writes it). Restore it "
                          "from a backup of the run folder; or, to start this node afresh, delete it and give the "
                          "node a federation.node_id the broker has not seen (the broker keeps the id for the "
                          "secret that first joined under it)")
    return text


def _create(path: Path) -> str:
    value = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, (value + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write this node's secret {path}: {exc}. The node needs its run folder "
                          "(run.output_dir) writable") from None
    return value

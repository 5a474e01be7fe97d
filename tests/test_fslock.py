"""graft_fed/fslock.py: the one exclusive flock the run folder, the broker's block files and
the allowlist's folder take."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time

import pytest

from graft_fed import fslock
from graft_fed.fslock import LockHeld, LockUnsupported, hold_exclusive
from tests.fds import open_under


def test_a_held_lock_is_refused_at_once_and_free_again_once_its_descriptor_closes(tmp_path):
    fd = hold_exclusive(tmp_path)
    with pytest.raises(LockHeld):  # a second open description, even in this process
        hold_exclusive(tmp_path)
    os.close(fd)
    os.close(hold_exclusive(tmp_path))


def test_a_lock_file_is_created_0600_and_a_missing_path_is_the_opens_own_error(tmp_path):
    fd = hold_exclusive(tmp_path / ".lock", lock_file=True)
    assert stat.S_IMODE(os.stat(tmp_path / ".lock").st_mode) == 0o600
    os.close(fd)
    with pytest.raises(FileNotFoundError) as info:
        hold_exclusive(tmp_path / "missing")
    assert not isinstance(info.value, LockUnsupported)


def test_waiting_blocks_until_the_holder_lets_go(tmp_path):
    fd = hold_exclusive(tmp_path)
    got: list[float] = []

    def waiter() -> None:
        os.close(hold_exclusive(tmp_path, wait=True))
        got.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    assert not got  # still waiting
    released = time.monotonic()
    os.close(fd)
    t.join(10)
    assert got and got[0] >= released


def test_a_filesystem_without_flock_is_told_apart_and_nothing_stays_open(tmp_path, monkeypatch):
    held = hold_exclusive(tmp_path)  # the check below sees a descriptor left open on the path
    assert open_under(tmp_path) == [str(tmp_path)]
    os.close(held)

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fslock.fcntl, "flock", no_locks)
    with pytest.raises(LockUnsupported) as info:
        hold_exclusive(tmp_path)
    assert info.value.errno == errno.ENOLCK and str(tmp_path) in str(info.value)
    with pytest.raises(LockUnsupported):
        hold_exclusive(tmp_path, wait=True)
    assert open_under(tmp_path) == []
    monkeypatch.setattr(fslock.fcntl, "flock", fcntl.flock)


def test_the_allowlist_is_edited_unlocked_with_a_warning_where_its_folder_cannot_be_locked(tmp_path, monkeypatch,
                                                                                            caplog):
    from graft_fed.broker.auth import Allowlist

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fslock.fcntl, "flock", no_locks)
    path = tmp_path / "allow.yaml"
    with caplog.at_level("WARNING"):
        lists = Allowlist.edit(path, "add", "node-a")
    assert "node-a" in lists["allowed"]
    assert "cannot lock the folder of allowlist" in caplog.text

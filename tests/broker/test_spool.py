"""Operators' requests to a running broker as files (broker/spool.py): each applied once and
answered; what is not a request is answered with what was wrong and never applied."""

import errno
import json
import os
import stat
import threading

import pytest

from graft_fed.broker import spool
from graft_fed.errors import GraftFedError


def _spool(tmp_path, done):
    def forget(node_id, options):
        if node_id == "refused":
            raise GraftFedError("not this one")
        if node_id == "broken":
            raise RuntimeError("boom")
        if set(options) - {"hold_for"}:
            raise ValueError(f"not the option {sorted(options)}")
        done.append(("forget_secret", node_id, *options.values()))
        return f"did forget_secret {node_id}"
    return spool.Spool(tmp_path / "b.sqlite", {"forget_secret": forget})


def test_a_request_is_applied_once_and_answered(tmp_path):
    done = []
    sp = _spool(tmp_path, done)
    assert stat.S_IMODE(os.stat(sp.path).st_mode) == 0o700
    answer = spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")
    assert spool.await_answer(answer, 0.05) is None  # nothing answers until the broker takes it
    assert sp.serve() == 1 and done == [("forget_secret", "alice")]
    assert sp.serve() == 0 and done == [("forget_secret", "alice")]  # once
    assert spool.await_answer(answer, 1.0) == {"ok": True, "message": "did forget_secret alice", "options": []}
    assert list(sp.path.iterdir()) == []  # the command deleted the answer, the broker the request
    # an action's options travel with the request
    answer = spool.submit(tmp_path / "b.sqlite", "forget_secret", "bob", {"hold_for": "ab" * 32})
    assert sp.serve() == 1 and done[-1] == ("forget_secret", "bob", "ab" * 32)
    assert spool.await_answer(answer, 1.0)["options"] == ["hold_for"]  # the command checks it was taken


def test_requests_are_applied_in_the_order_they_were_left(tmp_path, monkeypatch):
    """A plain forget left while the broker was busy, then a hold: applied in another order,
    the earlier forget would undo the hold. Random names alone sorted them at random."""
    done = []
    sp = _spool(tmp_path, done)
    names = iter(["ff" * 8, "00" * 8])  # the random part of the first sorts last
    monkeypatch.setattr(spool.secrets, "token_hex", lambda n: next(names))
    spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")
    spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice", {"hold_for": "ab" * 32})
    assert sp.serve() == 2 and done == [("forget_secret", "alice"), ("forget_secret", "alice", "ab" * 32)]


@pytest.mark.parametrize("body, why", [
    (b"{not json", "request refused"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"action": "drop_tables", "node_id": "alice"}).encode(), "unknown action 'drop_tables'"),
    (json.dumps({"action": "forget_secret", "node_id": 7}).encode(), "node_id must be a non-empty string"),
    (json.dumps({"action": "forget_secret"}).encode(), "node_id must be a non-empty string"),
    (json.dumps({"action": "forget_secret", "node_id": "x" * 5000}).encode(), "node_id must be"),
    (b" " * (spool.MAX_REQUEST_BYTES + 1), "more than 65536 bytes"),
    (b"\xff\xfe", "request refused"),
    (json.dumps({"action": "forget_secret", "node_id": "refused"}).encode(), "not this one"),
    (json.dumps({"action": "forget_secret", "node_id": "broken"}).encode(), "failed to apply it: boom"),
    (json.dumps({"action": "forget_secret", "node_id": "a", "options": ["hold_for"]}).encode(), "options must be"),
    (json.dumps({"action": "forget_secret", "node_id": "a", "options": {"hold_for": 7}}).encode(), "options must be"),
    (json.dumps({"action": "forget_secret", "node_id": "a", "options": {"hold_for": "x" * 5000}}).encode(),
     "options must be"),
    (json.dumps({"action": "forget_secret", "node_id": "a", "options": {str(i): "" for i in range(9)}}).encode(),
     "options must be"),
    (json.dumps({"action": "forget_secret", "node_id": "a", "options": {"drop": "all"}}).encode(), "not the option"),
])
def test_what_is_not_a_request_is_answered_with_what_was_wrong_and_never_applied(tmp_path, body, why):
    done = []
    sp = _spool(tmp_path, done)
    (sp.path / "r1.request").write_bytes(body)
    assert sp.serve() == 1 and done == []
    answer = json.loads((sp.path / "r1.answer").read_text())
    assert answer["ok"] is False and why in answer["message"], answer
    assert not (sp.path / "r1.request").exists()


def test_half_written_requests_other_files_and_old_answers(tmp_path):
    done = []
    sp = _spool(tmp_path, done)
    (sp.path / ".r2.request.tmp").write_text('{"action": "forget_secret", "node_id": "half"}')
    (sp.path / "notes.txt").write_text("not a request")
    old = sp.path / "r3.answer"
    old.write_text('{"ok": true, "message": "nobody came"}')
    os.utime(old, (1000.0, 1000.0))
    fresh = sp.path / "r4.answer"
    fresh.write_text('{"ok": true, "message": "being collected"}')
    assert sp.serve() == 0 and done == []
    assert sorted(p.name for p in sp.path.iterdir()) == [".r2.request.tmp", "notes.txt", "r4.answer"]


def test_a_request_without_the_folder_says_the_broker_is_too_old(tmp_path):
    with pytest.raises(GraftFedError, match="predates live requests"):
        spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")


def test_broker_running_is_whether_the_states_lock_is_held(tmp_path):
    from graft_fed.broker.state_sqlite import SqliteState

    db = tmp_path / "b.sqlite"
    assert spool.broker_running(db) is False  # never opened
    st = SqliteState(db)
    try:
        assert spool.broker_running(db) is True
    finally:
        st.close()
    assert spool.broker_running(db) is False


# ----- found in review: a pipe, an answer that cannot be written, links, the folder's owner

def test_a_fifo_named_as_a_request_does_not_block_the_housekeeping(tmp_path):
    # Spool.serve runs on the broker's housekeeping thread (heartbeat rescaling, readiness of
    # rounds closed by nodes going offline, liveness, retention): open() of a FIFO blocks
    # until a writer comes, so one FIFO (or a symlink to one) stops all of it for good
    sp = _spool(tmp_path, [])
    fifo = sp.path / "r1.request"
    os.mkfifo(fifo)
    t = threading.Thread(target=sp.serve, daemon=True)
    t.start()
    t.join(3.0)
    blocked = t.is_alive()
    if blocked:  # release the thread: a writer opens and closes the FIFO
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(3.0)
    assert not blocked, "Spool.serve blocked on a FIFO named *.request: the broker's housekeeping stops"


@pytest.mark.parametrize("how", ["disk_full", "answer_is_a_directory"])
def test_a_request_whose_answer_cannot_be_written_is_not_applied_again_every_second(tmp_path, monkeypatch, how):
    # serve applies the request, then writes the answer, then deletes the request; when the
    # answer cannot be written the request stays and is applied AGAIN at every pass (each
    # second): a forget_secret then drops, a second later, the secret the node brought when
    # it joined again, and again, so any Join can take the id
    done = []
    sp = _spool(tmp_path, done)
    answer = spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")
    if how == "disk_full":
        def full(path, payload):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(spool, "_write_atomic", full)
    else:
        answer.mkdir()
    for _ in range(3):
        sp.serve()
    assert done == [("forget_secret", "alice")], done


def test_writing_an_answer_does_not_follow_a_symlink_planted_as_its_temporary_file(tmp_path):
    # _write_atomic opens `.<id>.answer.tmp` with O_CREAT|O_TRUNC and no O_NOFOLLOW/O_EXCL,
    # and the id is the request's own name: whoever can put a request in the folder can make
    # the broker truncate and overwrite any file its user may write (its state, say)
    sp = _spool(tmp_path, [])
    victim = tmp_path / "victim.sqlite"
    victim.write_bytes(b"precious state")
    (sp.path / "r1.request").write_text(json.dumps({"action": "forget_secret", "node_id": "alice"}))
    os.symlink(victim, sp.path / ".r1.answer.tmp")
    sp.serve()
    assert victim.read_bytes() == b"precious state"


def test_an_existing_requests_folder_that_others_may_write_is_not_trusted(tmp_path):
    # the docs say the folder is 0700 ("whoever can write there could edit the state"), but
    # mkdir(exist_ok=True) keeps an existing folder's mode and owner unchecked, and serve
    # applies whatever it finds there: the state file itself is tightened to 0600 at start
    folder = spool.requests_dir(tmp_path / "b.sqlite")
    folder.mkdir()
    os.chmod(folder, 0o777)
    done = []
    try:
        sp = _spool(tmp_path, done)
    except (GraftFedError, OSError):
        return  # refusing to use it is a fix too
    (folder / "r1.request").write_text(json.dumps({"action": "forget_secret", "node_id": "alice"}))
    sp.serve()
    assert stat.S_IMODE(os.stat(folder).st_mode) & 0o077 == 0 or done == [], \
        f"mode {oct(stat.S_IMODE(os.stat(folder).st_mode))}, applied {done}"


def test_a_directory_named_as_a_request_is_not_answered_and_logged_again_every_second(tmp_path, caplog):
    sp = _spool(tmp_path, [])
    (sp.path / "r1.request").mkdir()
    with caplog.at_level("WARNING", logger="graft_fed.broker"):
        for _ in range(3):
            sp.serve()
    logged = [r.getMessage() for r in caplog.records if "r1.request" in r.getMessage()]
    assert len(logged) <= 2, logged  # one pass's worth, not one (or two) per second forever


def test_a_request_through_a_link_or_of_another_user_is_not_applied(tmp_path):
    done = []
    sp = _spool(tmp_path, done)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"action": "forget_secret", "node_id": "alice"}))
    os.symlink(target, sp.path / "r1.request")
    assert sp.serve() == 1 and done == []
    assert "not a file that can be read" in json.loads((sp.path / "r1.answer").read_text())["message"]
    assert target.exists()  # the link went, not what it named
    if os.geteuid() == 0:  # root can give a file away: one of another user is refused
        req = sp.path / "r2.request"
        req.write_text(json.dumps({"action": "forget_secret", "node_id": "bob"}))
        os.chown(req, 12345, 12345)
        assert sp.serve() == 1 and done == []
        assert "written by user 12345" in json.loads((sp.path / "r2.answer").read_text())["message"]


def test_a_requests_folder_of_another_user_or_a_link_is_not_served(tmp_path):
    db = tmp_path / "b.sqlite"
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, spool.requests_dir(db))
    with pytest.raises(GraftFedError, match="is not a folder"):
        spool.Spool(db, {})
    os.unlink(spool.requests_dir(db))
    if os.geteuid() == 0:
        spool.requests_dir(db).mkdir()
        os.chown(spool.requests_dir(db), 12345, 12345)
        with pytest.raises(GraftFedError, match="belongs to user 12345"):
            spool.Spool(db, {})


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_request_left_by_root_for_a_broker_of_another_user_is_that_users(tmp_path):
    sp = _spool(tmp_path, [])
    os.chown(sp.path, 12345, 12346)
    spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")
    (req,) = sp.path.glob("*.request")
    st = os.stat(req)
    assert (st.st_uid, st.st_gid) == (12345, 12346) and stat.S_IMODE(st.st_mode) == 0o600

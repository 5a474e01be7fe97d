"""Operators' requests to a running broker as files (broker/spool.py): each applied once and
answered; what is not a request is answered with what was wrong and never applied."""

import json
import os
import stat

import pytest

from graft_fed.broker import spool
from graft_fed.errors import GraftFedError


def _spool(tmp_path, done):
    def apply(action, node_id):
        if node_id == "refused":
            raise GraftFedError("not this one")
        if node_id == "broken":
            raise RuntimeError("boom")
        done.append((action, node_id))
        return f"did {action} {node_id}"
    return spool.Spool(tmp_path / "b.sqlite", apply)


def test_a_request_is_applied_once_and_answered(tmp_path):
    done = []
    sp = _spool(tmp_path, done)
    assert stat.S_IMODE(os.stat(sp.path).st_mode) == 0o700
    answer = spool.submit(tmp_path / "b.sqlite", "forget_secret", "alice")
    assert spool.await_answer(answer, 0.05) is None  # nothing answers until the broker takes it
    assert sp.serve() == 1 and done == [("forget_secret", "alice")]
    assert sp.serve() == 0 and done == [("forget_secret", "alice")]  # once
    assert spool.await_answer(answer, 1.0) == {"ok": True, "message": "did forget_secret alice"}
    assert list(sp.path.iterdir()) == []  # the command deleted the answer, the broker the request


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

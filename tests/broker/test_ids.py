"""Ids that end up in logs and on an operator's terminal are printable and one line."""

import pytest

from graft_fed.broker.sessions import check_id
from graft_fed.federation.errors import InvalidArgument


@pytest.mark.parametrize("bad", ["a\nb", "a\x1b[31mb", "a\x85b", "a\u2028b", "a\u2029b", "a\u200eb", "", "x" * 257])
def test_ids_that_could_forge_or_garble_a_log_line_are_refused(bad):
    with pytest.raises(InvalidArgument, match="node_id must be 1-256 printable characters"):
        check_id(bad, "node_id")


def test_printable_ids_from_any_script_are_taken():
    for good in ("alice", "inst-7_node.3", "café", "节点一", "a b"):
        check_id(good, "node_id")


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_forget_secret_on_the_state_in_every_case(tmp_path, backend):
    """`graft-fed broker forget-secret` (with the broker stopped, and inside a running one):
    what it changes and what it says, on both states. A session is ended only when what
    holds the id changes; under mutual TLS the answer does not claim the hash holds it."""
    from graft_fed.broker.sessions import forget_secret
    from graft_fed.broker.state import NodeRow
    from graft_fed.broker.state_memory import InMemoryState
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.federation.nodesecret import secret_hash

    state = InMemoryState() if backend == "memory" else SqliteState(tmp_path / "b.sqlite")
    h, t = secret_hash("s" * 64), secret_hash("m" * 64)
    try:
        state.upsert_node(NodeRow(node_id="alice", model_id="m", tokenizer_id="tok", privacy="share_all",
                                  state="online", session_id="abc", round=3, last_seen=1.0, published=7))
        state.set_node_secret("alice", t)
        said, ended = forget_secret(state, "alice", h.upper(), now=5.0)
        assert "held for the node whose secret hashes to" in said and "session is ended" in said, said
        assert state.node_secret("alice") == h
        assert ended is not None and ended.state == "left" and ended.last_seen == 5.0 and ended.published == 7
        assert state.get_node("alice") == ended
        said, ended = forget_secret(state, "alice", h)
        assert "already held" in said and ended is None  # nothing changes
        said, ended = forget_secret(state, "alice")
        assert "no longer held" in said and ended is None and state.node_secret("alice") == ""  # left already
        said, _ = forget_secret(state, "alice")
        assert "was not held" in said and "nothing changed" in said
        said, _ = forget_secret(state, "alcie", h)
        assert "no node has joined under this id" in said, said
        said, _ = forget_secret(state, "bob", h, mtls=True)
        assert "the certificate, not the hash, holds the id" in said and "only a Join" not in said, said
        with pytest.raises(ValueError, match="64 hexadecimal digits"):
            forget_secret(state, "alice", "xyz")
        assert state.node_secret("alice") == ""
    finally:
        state.close()

"""Full disks and damaged databases: the broker's SQLite state, a run's trajectory store and
its checkpoints. A damaged file stops the start with an error that names it and says what
to do (never a silently empty state); a full disk refuses the write that does not fit
(RESOURCE_EXHAUSTED), keeps everything acknowledged before, and the broker goes on
serving reads."""

import errno
import logging
import os
import sqlite3

import grpc
import pytest
import torch

from graft_fed.broker.handlers import Federation
from graft_fed.broker.server import BrokerServer
from graft_fed.broker.state import NodeRow, SummaryRow
from graft_fed.broker.state_sqlite import SqliteState
from graft_fed.cli import main
from graft_fed.core.records import GroupRecord
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.errors import CheckpointError, DataError, StorageError
from graft_fed.federation.errors import FederationError
from graft_fed.proto import broker_pb2 as pb
from graft_fed.store.sqlite import TrajectoryStore
from graft_fed.trainer import checkpoint as ckpt
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, code_of, record, summary

PAGE = 4096


@pytest.fixture()
def prompts(prompt_file):
    return load_prompts(DataConfig(source=str(prompt_file)))


def damage(path, offset, length):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(os.urandom(length))


def filled_state(path):
    st = SqliteState(path)
    st.upsert_node(NodeRow("a", "m", "t", "share_all", "online", "s", 0, 0.0))
    st.put_summaries([SummaryRow("a", r, f"p{i}", r, 8, 1, 0.125, 0.33, [5] * 8, [-0.5] * 8)
                      for r in range(100) for i in range(20)])
    st.close()
    assert os.path.getsize(path) > 4 * page_size(path)
    return path


def page_size(path):
    """The file's SQLite page size (header bytes 16-17; 1 means 65536)."""
    with open(path, "rb") as fh:
        fh.seek(16)
        size = int.from_bytes(fh.read(2), "big")
    return 65536 if size == 1 else size


# ----- damaged files ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["pages", "truncated", "header"])
def test_broker_refuses_a_damaged_state_file_at_start(how, prompt_file, tmp_path, capsys):
    db = filled_state(tmp_path / "broker.sqlite")
    if how == "pages":  # the header and schema are fine; data pages in the middle are not
        damage(db, 2 * page_size(db), page_size(db))
    elif how == "truncated":
        with open(db, "r+b") as fh:
            fh.truncate(os.path.getsize(db) // 2)
    else:
        damage(db, 0, 100)
    cfg = broker_config(prompt_file, db=str(db))
    with pytest.raises(DataError) as info:
        BrokerServer(cfg)
    message = str(info.value)
    assert str(db) in message and ("restore it from a backup" in message.lower())
    # the CLI says the same and exits non-zero, not with a traceback
    cfg_file = tmp_path / "broker.yaml"
    cfg_file.write_text(f"listen: 127.0.0.1:0\nhttp: ''\ndb: {db}\ndata: {{source: {prompt_file}}}\n"
                        "verifier: {name: tests.plugins:odd_char_sum}\nseed: 3\nn: 2\nprompts_per_round: 8\n")
    assert main(["broker", "--config", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert "error: broker state" in err and str(db) in err and "Traceback" not in err


def test_an_empty_state_file_is_never_taken_silently(tmp_path, caplog):
    empty = tmp_path / "broker.sqlite"
    empty.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="graft_fed.broker"):
        SqliteState(empty).close()
    assert any("exists but is empty" in r.getMessage() and str(empty) in r.getMessage() for r in caplog.records)


def test_trajectory_store_refuses_a_damaged_file(tmp_path):
    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as store:
        store.record(group(i, step) for step in range(40) for i in range(12))
    damage(path, 10 * PAGE, 3 * PAGE)
    with pytest.raises(DataError, match="not a readable trajectory store.*Restore it from a backup"):
        TrajectoryStore(path)
    with pytest.raises(DataError, match=str(path)):
        TrajectoryStore(path, readonly=True)


def test_a_corrupt_checkpoint_is_refused_and_the_previous_one_stays(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    root = tmp_path / "checkpoints"
    first = ckpt.save_checkpoint(root, 1, model, tok, {"step": 1}, "fp", keep=2)
    # a full disk while saving the next one: the save fails, the earlier checkpoint is untouched
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    torch.save = full_disk
    try:
        with pytest.raises(CheckpointError, match="step 2.*No space left.*step_000001.*is untouched") as info:
            ckpt.save_checkpoint(root, 2, model, tok, {"step": 2}, "fp", keep=2)
        assert info.value.errno == errno.ENOSPC
    finally:
        torch.save = real_save
    assert [p.name for p in root.iterdir()] == ["step_000001"]  # no half-written folder left behind
    assert ckpt.latest_checkpoint(root) == first  # the half-written one is not taken for a checkpoint
    assert ckpt.verify_checkpoint(first, "fp")["step"] == 1
    # a damaged one is refused with the way out
    weights = next(first.joinpath("model").glob("*.safetensors"))
    damage(weights, 200, 16)
    with pytest.raises(CheckpointError, match="corrupt.*resume from an earlier one"):
        ckpt.verify_checkpoint(first, "fp")


# ----- full disk ----------------------------------------------------------------------------------

def group(i, step):
    return GroupRecord(prompt_id=f"p{i}", step=step, model_id="m", tokenizer_id="t", problem="x" * 400, answer="1",
                       rewards=(1.0, 0.0), advantages=(0.7071, -0.7071), texts=("a" * 300, "b" * 300),
                       finish_reasons=("stop", "stop"), lengths=(3, 4), mean_logprobs=(-0.5, -0.25), run_id="r")


def cap_pages(conn):
    """Make the database 'full': it may not grow beyond the pages it has now (SQLITE_FULL)."""
    (pages,), = conn.execute("PRAGMA page_count").fetchall()
    conn.execute(f"PRAGMA max_page_count = {pages}")
    return pages


def fill_up(conn) -> None:
    """Make a capped database (cap_pages) full to its last free page: filler rows until
    SQLite refuses them, in the table `filler`, made before the cap (a database whose pages
    are all in use has none left for a new table's)."""
    size = 1 << 16
    while size:
        try:
            conn.execute("INSERT INTO filler VALUES (zeroblob(?))", (size,))
        except sqlite3.OperationalError as exc:
            assert "full" in str(exc)
            size //= 2


def test_broker_full_disk_refuses_the_write_keeps_the_acknowledged_and_serves_reads(prompt_file, prompts, tmp_path):
    db = tmp_path / "broker.sqlite"
    # 4 KiB pages (a file keeps the page size it has): a publish's row is a few bytes, its
    # block's being in a file (broker/blockfiles.py), so in the 64 KiB pages of a new file the
    # rows of thousands of rounds would fit in the pages the database has when it is capped
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA page_size = 4096")
        c.execute("CREATE TABLE t (x)")
        c.execute("DROP TABLE t")
    c.close()
    broker = start_broker(broker_config(prompt_file, db=str(db), max_publishes_per_s=0))
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    try:
        assert broker.state._conn.execute("PRAGMA page_size").fetchone() == (4096,)
        # a solves prompts 0-3 and fails 4-7, b the other way round: b is offered a's groups of 0-3
        assert a.publish(0, [summary(p, int(i < 4)) for i, p in enumerate(prompts[:8])]) == (8, 0)
        assert b.publish(0, [summary(p, int(i >= 4)) for i, p in enumerate(prompts[:8])]) == (8, 0)
        digest, stored = a.upload(record(prompts[0], 1), 0)
        assert stored
        assert b.get_matches(0, 5.0).ready
        with broker.state._lock:
            broker.state._conn.execute("CREATE TABLE filler (x BLOB)")
            cap_pages(broker.state._conn)
            fill_up(broker.state._conn)
        # publish rounds until the database cannot grow
        acked, failed = {0: 8}, None
        for rnd in range(1, 2000):  # 64 KiB pages: the last ones may take many small publishes
            try:
                assert a.publish(rnd, [summary(p, 1, round=rnd) for p in prompts[:8]]) == (8, 0)
                acked[rnd] = 8
            except FederationError as exc:
                failed = (rnd, grpc.StatusCode[exc.status], str(exc))
                break
        assert failed is not None, "the capped database never filled up"
        rnd, code, details = failed
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "storage is full" in details
        # nothing of the refused request was stored, everything acknowledged before is
        assert broker.state.summaries(round=rnd) == []
        by_round = {}
        for s in broker.state.summaries(node_id="a"):
            by_round[s.round] = by_round.get(s.round, 0) + 1
        assert by_round == acked
        # reads go on: status, bundle presence, fetching a matched bundle, matches of a matched round
        st = a.status()
        assert {n.node_id: n.published for n in st.nodes}["a"] == sum(acked.values())
        assert b.has_bundles([digest]) == {digest}
        assert b.fetch(digest).prompt_id == prompts[0].id
        assert b.get_matches(0, 0.0).ready
        # space comes back: the same publish now succeeds in full (it had left nothing behind)
        with broker.state._lock:
            broker.state._conn.execute("PRAGMA max_page_count = 1073741823")
        assert a.publish(rnd, [summary(p, 1, round=rnd) for p in prompts[:8]]) == (8, 0)
    finally:
        a.close()
        b.close()
        broker.stop()


class _NoSpace:
    """The broker's SQLite connection on a disk where every write fails (ENOSPC as SQLite
    reports it: SQLITE_FULL), reads still work."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql, *args):
        if sql.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode = sqlite3.SQLITE_FULL
            raise exc
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_broker_with_no_space_at_all_still_serves_reads(prompt_file, prompts, tmp_path):
    broker = start_broker(broker_config(prompt_file, db=str(tmp_path / "broker.sqlite")))
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    try:
        assert a.publish(0, [summary(prompts[0], 1), summary(prompts[1], 0)]) == (2, 0)
        assert b.publish(0, [summary(prompts[0], 0), summary(prompts[1], 1)]) == (2, 0)
        digest, _ = a.upload(record(prompts[0], 1), 0)
        assert b.get_matches(0, 5.0).ready
        with broker.state._lock:
            broker.state._conn = _NoSpace(broker.state._conn)
        for call in (lambda: a.publish(1, [summary(prompts[0], 1, round=1)]),
                     lambda: a.upload(record(prompts[1], 0), 0),
                     lambda: client(broker, prompts, "c")):
            code, details = code_of(call)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "storage is full" in details
        # every read still answers (the liveness touch of each call is skipped, not fatal)
        assert b.has_bundles([digest]) == {digest}
        assert b.fetch(digest).prompt_id == prompts[0].id
        assert [o.prompt_id for o in b.get_matches(0, 0.0).offers] == [prompts[0].id]
        assert {n.node_id: n.published for n in a.status().nodes} == {"a": 2, "b": 2}
        assert len(broker.state.summaries()) == 4
    finally:
        broker.state._conn = getattr(broker.state._conn, "_conn", broker.state._conn)
        a.close()
        b.close()
        broker.stop()


def test_trajectory_store_full_disk_is_a_clear_error_and_keeps_what_it_had(tmp_path):
    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as store:
        assert store.record(group(i, 0) for i in range(12)) == 12
        cap_pages(store.db)
        with pytest.raises(StorageError) as info:
            for step in range(1, 200):
                store.record(group(i, step) for i in range(12))
        assert str(path) in str(info.value) and "disk is full" in str(info.value)
        assert "--resume auto" in str(info.value)
        failed_step = step
        steps = sorted({r.step for r in store.iter_records()})
        assert steps == list(range(failed_step))  # every earlier step whole, nothing of the failed one
        assert all(len(store.lookup([f"p{i}" for i in range(12)], step=s)) == 12 for s in steps)


def test_a_damaged_stored_block_is_answered_unavailable_and_logged(prompt_file, prompts, tmp_path, caplog):
    """A block file that no longer holds what its row says (one byte changed on disk): the
    node whose stored block it is gets UNAVAILABLE ("the storage failed: retry later") when
    its next publish of that round reads it, never a bare INTERNAL, and the log says which
    block and why; another node's publish of the round is stored as usual."""
    db = tmp_path / "broker.sqlite"
    broker = start_broker(broker_config(prompt_file, db=str(db), max_publishes_per_s=0))
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    try:
        assert a.publish(0, [summary(p, 1) for p in prompts[:4]]) == (4, 0)
        with open(tmp_path / "broker.sqlite-blocks" / "r0", "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
        with caplog.at_level(logging.ERROR, logger="graft_fed"):
            code, details = code_of(lambda: a.publish(0, [summary(p, 1) for p in prompts[4:8]]))
        assert code == grpc.StatusCode.UNAVAILABLE and "storage failed" in details and "retry later" in details
        assert "stored summary block is damaged" in caplog.text and "node 'a', round 0" in caplog.text
        assert "do not match the checksum" in caplog.text
        assert b.publish(0, [summary(p, 0) for p in prompts[:8]]) == (8, 0)
        assert len(broker.state.summaries(node_id="b")) == 8
    finally:
        for c in (a, b):
            c.close()
        broker.stop()


def test_a_bundle_whose_stored_bytes_were_damaged_is_not_served_and_the_operator_is_told(
        prompt_file, prompts, tmp_path, caplog, monkeypatch):
    """A bundle's file changed on disk while the broker was down (one bit, same size): before,
    the restarted broker served it as it was, every receiver found a digest mismatch and
    reported the group undelivered, and the source looked like it withheld its groups. Now a
    bundle from before the broker's start is read whole at its first fetch: a damaged copy is
    NOT_FOUND (the receiver skips that offer), logged once, counted on /metrics, not read
    again and no longer counted held, so that its source uploads it again; an intact one is
    read whole once, not at every fetch."""
    from graft_fed.broker.server import render_metrics
    from graft_fed.federation.bundles import digest_of, encode_bundle
    from tests.federation.test_bundle_check import _flip_a_bit, _restarted_with_two_old_bundles

    broker, a, b, (good, bad) = _restarted_with_two_old_bundles(prompt_file, prompts, tmp_path)
    try:
        _flip_a_bit(broker.state.bundle_file(bad)[0])
        reads = []
        real = broker.state.iter_bundle
        monkeypatch.setattr(broker.state, "iter_bundle", lambda d, chunk: reads.append(d) or real(d, chunk))
        for _ in range(3):
            assert digest_of(encode_bundle(b.fetch_bundle(good, "a").record)) == good
        assert reads.count(good) == 4  # read whole once, then one stream per fetch

        def fetch():
            return list(b.stub.FetchBundle(pb.FetchBundleRequest(node_id="b", session_id=b.session, digest=bad),
                                           timeout=10))
        with caplog.at_level(logging.ERROR, logger="graft_fed"):
            for _ in range(2):
                code, details = code_of(fetch)
                assert code == grpc.StatusCode.NOT_FOUND and "copy is damaged" in details, details
        assert reads.count(bad) == 1
        errors = [r.getMessage() for r in caplog.records if "no longer hashes" in r.getMessage()]
        assert len(errors) == 1 and bad in errors[0]
        assert "graft_fed_bundles_damaged_total 1\n" in render_metrics(broker.fed, broker.servicer)
        # not counted held any more, so the source uploads it again (its node sends what the
        # broker does not hold), which replaces the copy: served, read once more to make sure
        assert a.has_bundles([good, bad]) == {good}
        assert a.upload(record(prompts[1], 1, "a"), 0) == (bad, False)  # its row was there; its file is new
        with open(broker.state.bundle_file(bad)[0], "rb") as fh:
            assert digest_of(fh.read()) == bad
        for _ in range(2):
            assert digest_of(encode_bundle(b.fetch_bundle(bad, "a").record)) == bad
        assert reads.count(bad) == 1 + 1 + 2 and a.has_bundles([bad]) == {bad}
        assert "graft_fed_bundles_damaged_total 1\n" in render_metrics(broker.fed, broker.servicer)
    finally:
        for c in (a, b):
            c.close()
        broker.stop()


# ----- a state of another federation -----------------------------------------------------------

def test_a_state_of_another_federation_is_refused_at_start(prompt_file, prompts, tmp_path):
    """A broker configured for another federation (another id, another n) on a state that
    holds a federation's rows does not start: the error names each field that differs, and
    the state is left as it was. The same configuration, and changed knobs, start."""
    db = tmp_path / "broker.sqlite"
    state = SqliteState(db)
    try:
        fed = Federation(broker_config(prompt_file, db=str(db), federation_id="fed-A", n=8), state)
        fed.join("alice", "m", "tok", fed.manifest, "share_all", 0)
        fed.stop()
    finally:
        state.close()
    state = SqliteState(db)
    try:
        with pytest.raises(DataError) as info:
            Federation(broker_config(prompt_file, db=str(db), federation_id="fed-B", n=4), state)
        message = str(info.value)
        assert str(db) in message and "federation_id: the state has 'fed-A', the configuration 'fed-B'" in message
        assert "n: the state has 8, the configuration 4" in message
        assert [n.node_id for n in state.list_nodes()] == ["alice"]
        fed = Federation(broker_config(prompt_file, db=str(db), federation_id="fed-A", n=8, mode="async",
                                       staleness_rounds=3), state)
        fed.stop()
    finally:
        state.close()


def test_a_broker_refused_at_start_lets_go_of_its_state(prompt_file, tmp_path):
    """A BrokerServer whose start is refused after it opened the state (a malformed
    allowlist, a state of another federation) closes it: trying again in the same process
    is not told that another broker holds the state."""
    from graft_fed.errors import ConfigError

    db = str(tmp_path / "broker.sqlite")
    allow = tmp_path / "allow.yaml"
    allow.write_text("allowed: [alice\n")
    for _ in range(2):
        with pytest.raises(ConfigError, match="is not valid YAML"):
            BrokerServer(broker_config(prompt_file, db=db, allowlist=str(allow)))
    allow.write_text("allowed: [alice]\n")
    server = BrokerServer(broker_config(prompt_file, db=db, allowlist=str(allow))).start()
    server.stop()

"""A trajectory store from another site (stored peers, `graft-fed store import`) may hold
anything: every row or line that is not a group record is a DataError naming the file,
never a traceback, and a group filed under another prompt is never served for this one."""

import json
import sqlite3

import pytest

from graft_fed.core.records import GroupRecord
from graft_fed.errors import DataError
from graft_fed.store.sqlite import TrajectoryStore


def group(pid, step=0):
    return GroupRecord(prompt_id=pid, step=step, model_id="m", tokenizer_id="t", problem="q", answer="1",
                       rewards=(1.0, 0.0), advantages=(0.7071, -0.7071), texts=("a", "b"),
                       finish_reasons=("stop", "stop"), lengths=(1, 1), mean_logprobs=(-0.5, -0.25), run_id="r")


HOSTILE = {
    "nested": "[" * 100_000 + "]" * 100_000,  # RecursionError in json.loads
    "huge integer": '{"step": ' + "9" * 10_000 + "}",  # ValueError (int digits limit), not JSONDecodeError
    "not an object": "[1, 2, 3]",
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_hostile_row_of_a_stored_peer_run_is_a_data_error(what, tmp_path):
    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as store:
        store.record([group("p1"), group("p2")])
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE groups SET payload = ? WHERE prompt_id = 'p1'", (HOSTILE[what],))
    conn.close()
    with TrajectoryStore(path, readonly=True) as store:
        assert store.lookup(["p2"], step=0) == {"p2": group("p2")}
        with pytest.raises(DataError, match=f"corrupt group in trajectory store {path}"):
            store.lookup(["p1"], step=0)


def test_a_stored_group_filed_under_another_prompt_is_never_served_for_it(tmp_path):
    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as store:
        store.record([group("p1"), group("p2")])
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE groups SET payload = ? WHERE prompt_id = 'p1'", (json.dumps(group("p2").to_dict()),))
    conn.close()
    with TrajectoryStore(path, readonly=True) as store:
        with pytest.raises(DataError, match="row of prompt 'p1' holds a group for prompt 'p2'"):
            store.lookup(["p1"], step=0)


@pytest.mark.parametrize("what", sorted(HOSTILE) + ["not utf-8"])
def test_importing_a_hostile_jsonl_is_a_data_error_and_imports_nothing(what, tmp_path):
    src = tmp_path / "groups.jsonl"
    good = json.dumps(group("p1").to_dict())
    if what == "not utf-8":
        src.write_bytes(good.encode() + b"\n\xff\xfe\n")
    else:
        src.write_text(good + "\n" + HOSTILE[what] + "\n", encoding="utf-8")
    store = tmp_path / "imported.sqlite"
    with pytest.raises(DataError, match=str(src)):
        TrajectoryStore.import_jsonl(src, store)
    assert not store.exists()

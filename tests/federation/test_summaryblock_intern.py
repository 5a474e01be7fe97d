"""Interned prompt-id lists (federation/summaryblock.py): equal lists become one object with
one memo; nothing else is interned; a block encodes the same bytes either way."""

import json

import numpy as np

from graft_fed.federation.summaryblock import SummaryBlock, facts_of, intern_ids


def test_equal_lists_are_one_object_with_one_memo():
    ids = [f"p{i}" for i in range(100)]
    first = intern_ids(list(ids))
    again = intern_ids(list(ids))
    assert again is first and again == ids
    facts_of(first)["x"] = 1
    assert facts_of(again) == {"x": 1}
    assert facts_of(list(ids)) is None  # an equal list that was not handed out by intern_ids
    other = intern_ids(ids[:-1])
    assert other is not first and facts_of(other) == {}


def test_lists_that_cannot_be_keyed_are_not_interned():
    for ids in ([], ["a\x00b", "c"], ["a", 1]):
        got = intern_ids(ids)
        assert got is ids and facts_of(got) is None
    # ["a\x00", "b"] and ["a", "\x00b"] would share a key: neither is interned
    assert facts_of(intern_ids(["a\x00", "b"])) is None and facts_of(intern_ids(["a", "\x00b"])) is None


def test_only_the_last_few_lists_are_kept():
    lists = [intern_ids([f"q{n}", "z"]) for n in range(20)]
    assert facts_of(lists[0]) is None and facts_of(lists[-1]) == {}
    assert intern_ids(["q0", "z"]) is not lists[0]


def _old_bytes(b: SummaryBlock) -> bytes:
    """The encoding as it was written before the memo (json.dumps of the whole header)."""
    i8, f8 = np.dtype("<i8"), np.dtype("<f8")
    header = json.dumps({"node_id": b.node_id, "round": b.round, "prompt_ids": b.prompt_ids, "nl": int(b.lengths.size),
                         "nm": int(b.mean_logprobs.size)}, separators=(",", ":")).encode()
    return b"".join([b"GFS1", len(header).to_bytes(4, "little"), header] + [
        a.astype(t).tobytes() for a, t in ((b.policy_version, i8), (b.n, i8), (b.k, i8), (b.reward_mean, f8),
                                           (b.reward_std, f8), (b.n_lengths, i8), (b.n_logprobs, i8),
                                           (b.lengths, i8), (b.mean_logprobs, f8))])


def test_a_block_encodes_the_same_bytes_with_or_without_an_interned_list():
    ids = ["p\u00e9", 'q"\\', "r\u2603"]
    for pids in (list(ids), intern_ids(list(ids)), intern_ids(list(ids))):
        b = SummaryBlock.from_columns('n\u00f6de"', 2**40, pids, [1, 2, 3], [2] * 3, [0, 1, 2], [0.0, 0.5, 1.0],
                                      [0.0, -0.0, float("nan")], [2] * 3, [2] * 3, [1, 2, 3, 4, 5, 2**40],
                                      [-0.0, -1.5, float("-inf"), -2.0, -1e-300, -3.0])
        assert b.to_bytes() == _old_bytes(b)
        back = SummaryBlock.from_bytes(b.to_bytes())
        assert back.prompt_ids == ids and back.node_id == 'n\u00f6de"' and back.lengths.tolist()[-1] == 2**40
    # arrays of narrower types (as the wire carries them) are widened on the way in
    b = SummaryBlock("n", 0, ["a"], np.array([7], dtype="<u8"), np.array([2], dtype="<u4"), np.array([1], dtype="<u4"),
                     np.array([0.5]), np.array([0.5]), np.array([2]), np.array([2]), np.array([3, 4], dtype="<u4"),
                     np.array([-1.0, -2.0]))
    assert b.to_bytes() == _old_bytes(b)

"""Interned prompt-id lists (federation/summaryblock.py): equal lists become one object with
one memo; nothing else is interned; a block encodes the same bytes either way. The block's
encoding: narrow integer widths, blocks of the older encoding, damaged blocks."""

import json

import numpy as np
import pytest

from graft_fed.federation.summaryblock import SummaryBlock, SummaryBlockError, facts_of, intern_ids


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


_INTS = ("policy_version", "n", "k", "n_lengths", "n_logprobs", "lengths")
_ORDER = ("policy_version", "n", "k", "reward_mean", "reward_std", "n_lengths", "n_logprobs", "lengths",
          "mean_logprobs")


def _narrowest(a: np.ndarray) -> str:
    for t in ("<i1", "<i2", "<i4"):
        info = np.iinfo(t)
        if a.size == 0 or (info.min <= int(a.min()) and int(a.max()) <= info.max):
            return t
    return "<i8"


def _reference_bytes(b: SummaryBlock) -> bytes:
    """The GFS2 encoding written independently: json.dumps of the whole header, each integer
    column in the narrowest signed type that holds it."""
    types = {c: (_narrowest(np.asarray(getattr(b, c), dtype=np.int64)) if c in _INTS else "<f8") for c in _ORDER}
    header = json.dumps({"node_id": b.node_id, "round": b.round, "prompt_ids": b.prompt_ids, "nl": int(b.lengths.size),
                         "nm": int(b.mean_logprobs.size), "w": [np.dtype(types[c]).itemsize for c in _INTS]},
                        separators=(",", ":")).encode()
    return b"".join([b"GFS2", len(header).to_bytes(4, "little"), header] + [
        np.asarray(getattr(b, c), dtype=np.int64 if c in _INTS else np.float64).astype(types[c]).tobytes()
        for c in _ORDER])


def _v1_bytes(b: SummaryBlock) -> bytes:
    """The encoding blocks were stored in before the narrow widths (every integer int64)."""
    header = json.dumps({"node_id": b.node_id, "round": b.round, "prompt_ids": b.prompt_ids, "nl": int(b.lengths.size),
                         "nm": int(b.mean_logprobs.size)}, separators=(",", ":")).encode()
    return b"".join([b"GFS1", len(header).to_bytes(4, "little"), header] + [
        getattr(b, c).astype("<i8" if c in _INTS else "<f8").tobytes() for c in _ORDER])


def _same(a: SummaryBlock, b: SummaryBlock) -> None:
    assert (a.node_id, a.round, a.prompt_ids) == (b.node_id, b.round, b.prompt_ids)
    for c in _ORDER:
        x, y = getattr(a, c), getattr(b, c)
        assert x.dtype == y.dtype == (np.int64 if c in _INTS else np.float64), c
        assert x.tobytes() == y.tobytes(), c  # floats bit for bit


def _block(pids, lengths) -> SummaryBlock:
    return SummaryBlock.from_columns('n\u00f6de"', 2**40, pids, [1, 2, 3], [2] * 3, [0, 1, 2], [0.0, 0.5, 1.0],
                                     [0.0, -0.0, float("nan")], [2] * 3, [2] * 3, lengths,
                                     [-0.0, -1.5, float("-inf"), -2.0, -1e-300, -3.0])


def test_a_block_encodes_the_same_bytes_with_or_without_an_interned_list():
    ids = ["p\u00e9", 'q"\\', "r\u2603"]
    for pids in (list(ids), intern_ids(list(ids)), intern_ids(list(ids))):
        b = _block(pids, [1, 2, 3, 4, 5, 2**40])
        assert b.to_bytes() == _reference_bytes(b)
        back = SummaryBlock.from_bytes(b.to_bytes())
        assert back.prompt_ids == ids and back.node_id == 'n\u00f6de"' and back.lengths.tolist()[-1] == 2**40
        _same(back, b)
    # arrays of narrower types (as the wire carries them) are widened on the way in
    b = SummaryBlock("n", 0, ["a"], np.array([7], dtype="<u8"), np.array([2], dtype="<u4"), np.array([1], dtype="<u4"),
                     np.array([0.5]), np.array([0.5]), np.array([2]), np.array([2]), np.array([3, 4], dtype="<u4"),
                     np.array([-1.0, -2.0]))
    assert b.to_bytes() == _reference_bytes(b)


def test_each_integer_column_takes_the_narrowest_width_that_holds_it_and_reads_back_exactly():
    edges = [-2**63, -2**31 - 1, -2**31, -2**15 - 1, -2**15, -129, -128, 0, 127, 128, 2**15 - 1, 2**15,
             2**31 - 1, 2**31, 2**63 - 1]
    for lo in edges:
        for hi in edges:
            if hi < lo:
                continue
            b = _block(["a", "b", "c"], [lo, hi, 1, 1, 1, 1])
            data = b.to_bytes()
            assert data == _reference_bytes(b)
            _same(SummaryBlock.from_bytes(data), b)
            ids, n, k = SummaryBlock.heads_of(data)
            assert ids == ["a", "b", "c"] and n.tolist() == [2] * 3 and k.tolist() == [0, 1, 2]
            assert n.dtype == k.dtype == np.int64
    empty = SummaryBlock.from_columns("n", 0, [], *([[]] * 9))
    _same(SummaryBlock.from_bytes(empty.to_bytes()), empty)


def test_a_typical_row_is_stored_in_about_half_the_bytes():
    rng = np.random.default_rng(0)
    count, n = 512, 8
    b = SummaryBlock.from_columns("node", 3, [f"prompt-{i:05d}" for i in range(count)], [7] * count, [n] * count,
                                  rng.integers(0, n + 1, count), [0.5] * count, [0.5] * count, [n] * count,
                                  [n] * count, rng.integers(1, 4096, count * n), -rng.random(count * n))
    assert len(b.to_bytes()) < 0.62 * len(_v1_bytes(b))
    _same(SummaryBlock.from_bytes(b.to_bytes()), b)


def test_blocks_stored_before_the_narrow_widths_still_decode():
    b = _block(["a", "b", "c"], [1, 2, 3, 4, 5, 2**40])
    old = _v1_bytes(b)
    _same(SummaryBlock.from_bytes(old), b)
    ids, n, k = SummaryBlock.heads_of(old)
    assert ids == ["a", "b", "c"] and k.tolist() == [0, 1, 2]


def test_a_damaged_header_or_body_is_a_clear_error():
    good = _block(["a", "b", "c"], [1, 2, 3, 4, 5, 6]).to_bytes()
    size = int.from_bytes(good[4:8], "little")
    head = json.loads(good[8:8 + size])

    def with_head(**change) -> bytes:
        h = json.dumps({**head, **change}, separators=(",", ":")).encode()
        return b"GFS2" + len(h).to_bytes(4, "little") + h + good[8 + size:]

    bad_heads = [with_head(w=[1] * 5), with_head(w=[3, 1, 1, 1, 1, 1]), with_head(w="111111"),
                 with_head(w=[True, 1, 1, 1, 1, 1]), with_head(w=[8, 8, 8, 8, 8, 8])]
    no_w = dict(head)
    del no_w["w"]
    h = json.dumps(no_w).encode()
    bad_heads.append(b"GFS2" + len(h).to_bytes(4, "little") + h + good[8 + size:])
    h = b"[1, 2]"
    bad_heads.append(b"GFS2" + len(h).to_bytes(4, "little") + h + good[8 + size:])
    # hostile counts and fields: a negative count must not shift the columns it is summed with
    bad_heads += [with_head(nl=-8, nm=2), with_head(nl=2**70), with_head(nm="6"), with_head(nl=6.0),
                  with_head(prompt_ids="abc"), with_head(prompt_ids=["a", 1, "c"]), with_head(round=1.5),
                  with_head(round="1"), with_head(node_id=None)]
    h = b'{"nl": Infinity}'
    bad_heads.append(b"GFS2" + len(h).to_bytes(4, "little") + h + good[8 + size:])
    h = b"[" * 100_000 + b"]" * 100_000
    bad_heads.append(b"GFS2" + len(h).to_bytes(4, "little") + h)
    for data in bad_heads + [good[:-1], good + b"\0", b"GFS3" + good[4:], good[:8 + size + 2]]:
        with pytest.raises(SummaryBlockError, match="does not decode"):
            SummaryBlock.from_bytes(data)
    for data in bad_heads + [good[:-1], good + b"\0", good[:8 + size + 2]]:
        with pytest.raises(SummaryBlockError, match="does not decode"):
            SummaryBlock.heads_of(data)


def test_per_summary_counts_that_do_not_partition_the_flat_arrays_are_a_clear_error():
    # counts [3, -1] sum to the 2 lengths there are; [2**62] * 4 would wrap to 0 in int64
    def block(n_lengths, lengths):
        return SummaryBlock("n", 0, ["a"] * len(n_lengths), *(np.zeros(len(n_lengths), dtype=np.int64),) * 3,
                            np.zeros(len(n_lengths)), np.zeros(len(n_lengths)), np.array(n_lengths, dtype=np.int64),
                            np.zeros(len(n_lengths), dtype=np.int64), np.array(lengths, dtype=np.int64),
                            np.zeros(0))
    for n_lengths, lengths in (([3, -1], [5, 6]), ([2**62] * 4, []), ([1, 0], [7, 8]), ([], [1])):
        with pytest.raises(SummaryBlockError, match="does not decode"):
            SummaryBlock.from_bytes(block(n_lengths, lengths).to_bytes())
    ok = block([0, 2], [7, 8])
    assert SummaryBlock.from_bytes(ok.to_bytes()).n_lengths.tolist() == [0, 2]


def test_a_stored_value_that_is_not_bytes_is_a_clear_error():
    for data in ("GFS2 text", 7, None):
        with pytest.raises(SummaryBlockError, match=r"^a stored summary block does not decode \(a \w+, not bytes\)$"):
            SummaryBlock.from_bytes(data)
        with pytest.raises(SummaryBlockError, match="not bytes"):
            SummaryBlock.header(data)

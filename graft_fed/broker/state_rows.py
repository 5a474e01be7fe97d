"""Row normalisation and the arithmetic every `BrokerState` implementation shares.

A neutral module (the in-memory test double and the SQLite state both import it, neither
imports the other), so that the implementations cannot drift apart on what they accept,
how they key and order rows, or how they fold compatibility reports.
See docs/broker-state.md for the contract.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Iterable, Mapping, Sequence

import numpy as np

from graft_fed.broker.state import CompatRow, MatchRow, NodeRow, ReportRow, ReportRows, RoundRow, SummaryRow
from graft_fed.core.exchange import CompatEstimate
from graft_fed.federation.messages import ReportColumns, undelivered_but_scored
from graft_fed.federation.summaryblock import SummaryBlock, facts_of, holds_as_int64

_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1  # what SQLite's INTEGER holds


# ---------------------------------------------------------------- shared normalisation
# Every row is normalised on the way in: a fresh object with plain Python types, so that
# (1) the caller keeps no reference into the state, (2) numpy scalars and the like are
# accepted the same way by every implementation, and (3) a wrong type fails before any
# write. Wrong types raise TypeError, out-of-range values ValueError.

def as_int(value, what: str) -> int:
    if type(value) is int and _INT_MIN <= value <= _INT_MAX:  # the common case, checked first (publish rates)
        return value
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got the bool {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None
    if not _INT_MIN <= out <= _INT_MAX:
        raise ValueError(f"{what}={out} does not fit a signed 64-bit integer")
    return int(out)


def as_float(value, what: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (str, bytes, bytearray)) or value is None:
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})") from None


def as_str(value, what: str) -> str:
    if type(value) is str and value.isascii():  # no lone surrogate possible
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {value!r} ({type(value).__name__})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what}={value!r} is not valid Unicode (lone surrogate)") from None
    return str(value)


def int_list(values, what: str) -> list[int]:
    """A fresh list of `as_int` of each value (one pass when they are plain ints already)."""
    out = list(values)
    if all(type(v) is int for v in out) and (not out or (_INT_MIN <= min(out) and max(out) <= _INT_MAX)):
        return out
    return [as_int(v, what) for v in out]


def float_list(values, what: str) -> list[float]:
    """A fresh list of `as_float` of each value (one pass when they are plain floats already)."""
    out = list(values)
    if all(type(v) is float for v in out):
        return out
    return [as_float(v, what) for v in out]


def norm_node(row: NodeRow) -> NodeRow:
    return NodeRow(node_id=as_str(row.node_id, "node_id"), model_id=as_str(row.model_id, "model_id"),
                   tokenizer_id=as_str(row.tokenizer_id, "tokenizer_id"), privacy=as_str(row.privacy, "privacy"),
                   state=as_str(row.state, "state"), session_id=as_str(row.session_id, "session_id"),
                   round=as_int(row.round, "round"), last_seen=as_float(row.last_seen, "last_seen"),
                   published=as_int(row.published, "published"))


def norm_round(row: RoundRow) -> RoundRow:
    return RoundRow(round=as_int(row.round, "round"), state=as_str(row.state, "state"),
                    opened_at=as_float(row.opened_at, "opened_at"),
                    matched_at=None if row.matched_at is None else as_float(row.matched_at, "matched_at"),
                    participants=[as_str(p, "participants") for p in row.participants])


def norm_summary(row: SummaryRow) -> SummaryRow:
    where = f"summary ({row.node_id!r}, {row.round!r}, {row.prompt_id!r})"
    return SummaryRow(node_id=as_str(row.node_id, "node_id"), round=as_int(row.round, "round"),
                      prompt_id=as_str(row.prompt_id, "prompt_id"),
                      policy_version=as_int(row.policy_version, f"{where} policy_version"),
                      n=as_int(row.n, f"{where} n"), k=as_int(row.k, f"{where} k"),
                      reward_mean=as_float(row.reward_mean, f"{where} reward_mean"),
                      reward_std=as_float(row.reward_std, f"{where} reward_std"),
                      lengths=int_list(row.lengths, f"{where} lengths[]"),
                      mean_logprobs=float_list(row.mean_logprobs, f"{where} mean_logprobs[]"),
                      bundle_digest=as_str(row.bundle_digest, f"{where} bundle_digest"))


def _int_column(a: object) -> np.ndarray:
    """An integer column as it is when int64 holds its type, else converted to int64
    (TypeError where that would not be safe)."""
    a = np.asarray(a)
    return a if holds_as_int64(a) else a.astype(np.int64, casting="safe")


def norm_block(block: SummaryBlock) -> SummaryBlock:
    """The summary block with its types checked (what `norm_summary` is for rows): a new
    block, sharing the columns already of their type (to be encoded, not kept)."""
    if not isinstance(block, SummaryBlock):
        raise TypeError(f"expected a SummaryBlock, got {type(block).__name__}")
    count = len(block.prompt_ids)
    arrays = (block.policy_version, block.n, block.k, block.reward_mean, block.reward_std, block.n_lengths,
              block.n_logprobs)
    if any(not isinstance(a, np.ndarray) or a.shape != (count,) for a in arrays):
        raise ValueError("every column of a summary block holds one value per summary")
    total_lengths = int(block.n_lengths.sum())
    total_logprobs = total_lengths if block.n_logprobs is block.n_lengths else int(block.n_logprobs.sum())
    if total_lengths != block.lengths.size or total_logprobs != block.mean_logprobs.size:
        raise ValueError("a summary block's per-summary counts disagree with its flat arrays")
    if block.digests is not None and len(block.digests) != count:
        raise ValueError("a summary block's digests hold one value per summary")
    # no copy of a column already of its type: the SQLite state, the one caller, encodes
    # the block before it returns (a copy cost ~0.15 ms and an interpreter hand-off per
    # column and publish, issue 13)
    ints = [_int_column(a) for a in (block.policy_version, block.n, block.k, block.n_lengths, block.n_logprobs,
                                     block.lengths)]
    floats = [np.asarray(a).astype(np.float64, casting="safe", copy=False)
              for a in (block.reward_mean, block.reward_std, block.mean_logprobs)]
    facts = facts_of(block.prompt_ids)
    if facts is not None and facts.get("ascii"):  # an interned list (never changed in place) checked before
        pids = block.prompt_ids
    else:
        pids = list(block.prompt_ids)
        if not (set(map(type, pids)) <= {str} and "".join(pids).isascii()):  # else one by one (lone surrogates)
            pids = [as_str(p, "prompt_id") for p in pids]
        elif facts is not None:
            facts["ascii"] = True
    return SummaryBlock(as_str(block.node_id, "node_id"), as_int(block.round, "round"), pids, ints[0], ints[1], ints[2], floats[0],
                        floats[1], ints[3], ints[4], ints[5], floats[2],
                        None if block.digests is None else [as_str(d, "bundle_digest") for d in block.digests])


def norm_match(row: MatchRow) -> MatchRow:
    return MatchRow(round=as_int(row.round, "round"), receiver=as_str(row.receiver, "receiver"),
                    prompt_id=as_str(row.prompt_id, "prompt_id"), source=as_str(row.source, "source"),
                    source_round=as_int(row.source_round, "source_round"))


def norm_bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"bundle data must be bytes, got {type(data).__name__}")
    return bytes(data)


#: a report row as `report_fields` gives it: (round, receiver, source, prompt_id, mean_s,
#: admitted_fraction, rejected, undelivered)
ReportFields = tuple[int, str, str, str, float, float, bool, bool]


def report_fields(row: ReportRow) -> ReportFields:
    """The row's fields, checked, as a plain tuple: a tuple of numbers and strings is one
    the garbage collector stops tracking at its next look, so a batch of them waiting for
    its commit does not fill the collector's older generations (a ReportRow would)."""
    if not isinstance(row.rejected, bool):
        raise TypeError(f"rejected must be a bool, got {row.rejected!r}")
    if not isinstance(row.undelivered, bool):
        raise TypeError(f"undelivered must be a bool, got {row.undelivered!r}")
    if undelivered_but_scored(row.mean_s, row.admitted_fraction, row.rejected, row.undelivered):
        raise ValueError("an undelivered group has mean_s and admitted_fraction 0 and is not rejected")
    return (as_int(row.round, "round"), as_str(row.receiver, "receiver"), as_str(row.source, "source"),
            as_str(row.prompt_id, "prompt_id"), as_float(row.mean_s, "mean_s"),
            as_float(row.admitted_fraction, "admitted_fraction"), row.rejected, row.undelivered)


#: a run of a report's rows of one (round, receiver), as columns, checked
ReportSegment = tuple[int, str, ReportColumns]


def report_segments(rows: Sequence[ReportRow]) -> list[ReportSegment]:
    """The rows checked (`report_fields` of each) as runs of one (round, receiver) each, in
    order, their fields as columns. A `ReportRows` whose columns hold plain values (as the
    broker's reports do) is one run, checked a column at a time, no `ReportRow` or tuple
    made: 64 reports of 1,229 groups a round made 78,000 of each (issue 13). Anything else,
    or a column that is not plain, goes row by row, which says what is wrong."""
    if isinstance(rows, ReportRows) and _plain_columns(rows):
        return [(rows.round, rows.receiver, ReportColumns(rows.sources, rows.prompt_ids, rows.mean_s,
                                                          rows.admitted_fraction, rows.rejected, rows.undelivered))]
    out: list[ReportSegment] = []
    for fields in map(report_fields, rows):
        if not out or out[-1][:2] != fields[:2]:
            out.append((fields[0], fields[1], ReportColumns.empty()))
        for col, value in zip(out[-1][2], fields[2:]):
            col.append(value)
    return out


def _plain_columns(rows: ReportRows) -> bool:
    """Whether every value is what `report_fields` would pass unchanged (each column's types
    read in C: `map`, a set)."""
    if not (type(rows.round) is int and _INT_MIN <= rows.round <= _INT_MAX
            and type(rows.receiver) is str and rows.receiver.isascii()):
        return False
    n = len(rows.sources)  # the lists stay the caller's: one may have grown since the report was made
    if not all(len(col) == n for col in (rows.prompt_ids, rows.mean_s, rows.admitted_fraction, rows.rejected,
                                         rows.undelivered)):
        return False
    for col, kind in ((rows.sources, str), (rows.prompt_ids, str), (rows.mean_s, float),
                      (rows.admitted_fraction, float), (rows.rejected, bool), (rows.undelivered, bool)):
        if not set(map(type, col)) <= {kind}:
            return False
    return (all(map(str.isascii, rows.sources)) and all(map(str.isascii, rows.prompt_ids))
            and (not any(rows.undelivered) or not any(undelivered_but_scored(m, a, r, u) for m, a, r, u in zip(
                rows.mean_s, rows.admitted_fraction, rows.rejected, rows.undelivered) if u)))


def norm_report(row: ReportRow) -> ReportRow:
    """The row checked, as a ReportRow of its own."""
    return ReportRow(*report_fields(row))


def norm_blob(value, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
    return bytes(value)


def opt_int(value, what: str) -> int | None:
    return None if value is None else as_int(value, what)


def opt_str(value, what: str) -> str | None:
    return None if value is None else as_str(value, what)


def norm_prompt_ids(prompt_ids: Iterable[str] | None) -> list[str] | None:
    if prompt_ids is None:
        return None
    if isinstance(prompt_ids, str):  # a bare string would silently filter by its characters
        raise TypeError("prompt_ids must be an iterable of str, not one str")
    return [as_str(p, "prompt_ids[]") for p in prompt_ids]


def norm_digests(digests: Sequence[str]) -> list[str]:
    if isinstance(digests, str):
        raise TypeError("digests must be a sequence of str, not one str")
    return [as_str(d, "digests[]") for d in digests]


def check_prune_args(keep_rounds: int | None, max_bundle_bytes: int | None) -> None:
    if keep_rounds is not None and as_int(keep_rounds, "keep_rounds") < 1:
        raise ValueError(f"keep_rounds must be at least 1 (None keeps every round), got {keep_rounds}")
    if max_bundle_bytes is not None and as_int(max_bundle_bytes, "max_bundle_bytes") < 0:
        raise ValueError(f"max_bundle_bytes must be >= 0 (None keeps every bundle), got {max_bundle_bytes}")


def lower_counts(counts: Counter[str], by: Mapping[str, int]) -> None:
    """Lower per-node counts (the quotas' counts: what a state holds, what uploads have in
    flight) by `by`; a node left with none leaves the counter."""
    for node, n in by.items():
        left = counts[node] - n
        if left > 0:
            counts[node] = left
        else:
            counts.pop(node, None)


def prune_cutoff(latest: int, keep_rounds: int | None) -> int | None:
    """Rounds below the returned number are dropped; None when nothing is."""
    if keep_rounds is None or latest < 0:
        return None
    return latest - keep_rounds + 1


def bundles_to_drop(oldest_first: Sequence[tuple[str, int]], max_bundle_bytes: int | None) -> list[str]:
    """Digests to drop, oldest first, so the remaining total is at most `max_bundle_bytes`."""
    if max_bundle_bytes is None:
        return []
    total = sum(size for _, size in oldest_first)
    drop = []
    for digest, size in oldest_first:
        if total <= max_bundle_bytes:
            break
        drop.append(digest)
        total -= size
    return drop


def fold_compat(row: CompatRow | None, source: str, receiver: str,
                reports: Iterable[tuple[float, float, bool] | tuple[float, float, bool, bool]]) -> CompatRow:
    """The pair's row after more reports, (mean_s, admitted_fraction, rejected[,
    undelivered]) each, in order (core.exchange.CompatEstimate: a rejected report only
    increments `rejected`; otherwise both means are plain running means over groups, an
    undelivered group's 0 included; undelivered ones are also counted apart, for the
    quarantine rate, which leaves them out)."""
    reports = list(reports)
    est = CompatEstimate() if row is None else CompatEstimate(row.groups, row.mean_s, row.admitted_fraction,
                                                              row.rejected)
    est = est.add_many(r[:3] for r in reports)
    undelivered = (0 if row is None else row.undelivered) + sum(1 for r in reports if len(r) > 3 and r[3])
    return CompatRow(source=source, receiver=receiver, groups=est.groups, mean_s=est.mean_s,
                     admitted_fraction=est.admitted_fraction, rejected=est.rejected, undelivered=undelivered)


def norm_compat_args(source, receiver, mean_s, admitted_fraction, rejected) -> tuple[str, str, float, float, bool]:
    if not isinstance(rejected, bool):
        raise TypeError(f"rejected must be a bool, got {rejected!r}")
    return (as_str(source, "source"), as_str(receiver, "receiver"), as_float(mean_s, "mean_s"),
            as_float(admitted_fraction, "admitted_fraction"), rejected)


def norm_pairs(pairs) -> list[tuple[str, str]]:
    """(source, receiver) pairs of node ids, checked."""
    out = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"a pair must be a (source, receiver) tuple, got {pair!r}")
        out.append((as_str(pair[0], "source"), as_str(pair[1], "receiver")))
    return out


def summary_key(row: SummaryRow) -> tuple[int, str, str]:
    """Result order of `summaries()`: round, node, prompt."""
    return (row.round, row.node_id, row.prompt_id)


def match_key(row: MatchRow) -> tuple[int, str, str]:
    """Result order of `matches()`: round, receiver, prompt."""
    return (row.round, row.receiver, row.prompt_id)


def report_key(row: ReportRow) -> tuple[int, str, str, str]:
    """Identity and result order of reports: round, receiver, source, prompt."""
    return (row.round, row.receiver, row.source, row.prompt_id)



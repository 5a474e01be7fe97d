"""In-memory `BrokerState`: dicts behind one re-entrant lock. For tests and for a broker that
does not need to survive a restart.

Besides `InMemoryState`, this module holds the row normalisation and the arithmetic both
implementations share (`state_sqlite` imports them), so that the two cannot drift apart on
what they accept, how they order results or how they fold compatibility reports.
See docs/broker-state.md for the contract.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Any, Iterable, Sequence

from graft_fed.broker.state import BrokerState, CompatRow, MatchRow, NodeRow, ReportRow, RoundRow, SummaryRow
from graft_fed.core.exchange import CompatEstimate

_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1  # what SQLite's INTEGER holds


# ---------------------------------------------------------------- shared normalisation
# Every row is normalised on the way in: a fresh object with plain Python types, so that
# (1) the caller keeps no reference into the state, (2) numpy scalars and the like are
# accepted the same way by every implementation, and (3) a wrong type fails before any
# write. Wrong types raise TypeError, out-of-range values ValueError.

def as_int(value, what: str) -> int:
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
    if isinstance(value, (str, bytes, bytearray)) or value is None:
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})") from None


def as_str(value, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {value!r} ({type(value).__name__})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what}={value!r} is not valid Unicode (lone surrogate)") from None
    return str(value)


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
                      lengths=[as_int(x, f"{where} lengths[]") for x in row.lengths],
                      mean_logprobs=[as_float(x, f"{where} mean_logprobs[]") for x in row.mean_logprobs],
                      bundle_digest=as_str(row.bundle_digest, f"{where} bundle_digest"))


def norm_match(row: MatchRow) -> MatchRow:
    return MatchRow(round=as_int(row.round, "round"), receiver=as_str(row.receiver, "receiver"),
                    prompt_id=as_str(row.prompt_id, "prompt_id"), source=as_str(row.source, "source"),
                    source_round=as_int(row.source_round, "source_round"))


def norm_bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"bundle data must be bytes, got {type(data).__name__}")
    return bytes(data)


def norm_report(row: ReportRow) -> ReportRow:
    if not isinstance(row.rejected, bool):
        raise TypeError(f"rejected must be a bool, got {row.rejected!r}")
    return ReportRow(round=as_int(row.round, "round"), receiver=as_str(row.receiver, "receiver"),
                     source=as_str(row.source, "source"), prompt_id=as_str(row.prompt_id, "prompt_id"),
                     mean_s=as_float(row.mean_s, "mean_s"), admitted_fraction=as_float(row.admitted_fraction,
                                                                                    "admitted_fraction"),
                     rejected=row.rejected)


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


def fold_compat(row: CompatRow | None, source: str, receiver: str, mean_s: float, admitted_fraction: float,
                rejected: bool) -> CompatRow:
    """The pair's row after one more report (core.exchange.CompatEstimate: a rejected report
    only increments `rejected`; otherwise both means are plain running means over groups)."""
    est = CompatEstimate() if row is None else CompatEstimate(row.groups, row.mean_s, row.admitted_fraction,
                                                              row.rejected)
    est = est.add(mean_s, admitted_fraction, rejected)
    return CompatRow(source=source, receiver=receiver, groups=est.groups, mean_s=est.mean_s,
                     admitted_fraction=est.admitted_fraction, rejected=est.rejected)


def norm_compat_args(source, receiver, mean_s, admitted_fraction, rejected) -> tuple[str, str, float, float, bool]:
    if not isinstance(rejected, bool):
        raise TypeError(f"rejected must be a bool, got {rejected!r}")
    return (as_str(source, "source"), as_str(receiver, "receiver"), as_float(mean_s, "mean_s"),
            as_float(admitted_fraction, "admitted_fraction"), rejected)


def summary_key(row: SummaryRow) -> tuple[int, str, str]:
    """Result order of `summaries()`: round, node, prompt."""
    return (row.round, row.node_id, row.prompt_id)


def match_key(row: MatchRow) -> tuple[int, str, str]:
    """Result order of `matches()`: round, receiver, prompt."""
    return (row.round, row.receiver, row.prompt_id)


def report_key(row: ReportRow) -> tuple[int, str, str, str]:
    """Identity and result order of reports: round, receiver, source, prompt."""
    return (row.round, row.receiver, row.source, row.prompt_id)


def _copy_summary(row: SummaryRow) -> SummaryRow:
    return dataclasses.replace(row, lengths=list(row.lengths), mean_logprobs=list(row.mean_logprobs))


def _filtered(rows: Iterable[Any], round: int | None, receiver: str | None, source: str | None) -> list[Any]:
    """Copies of the match or report rows with the given round / receiver / source (each optional)."""
    round, receiver, source = opt_int(round, "round"), opt_str(receiver, "receiver"), opt_str(source, "source")
    return [dataclasses.replace(r) for r in rows
            if (round is None or r.round == round)
            and (receiver is None or r.receiver == receiver)
            and (source is None or r.source == source)]


# ---------------------------------------------------------------- the implementation

class InMemoryState(BrokerState):
    """`BrokerState` in process memory. Nothing survives the process; everything else in
    the contract holds (atomic methods, copies in and out, thread safety)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeRow] = {}
        self._rounds: dict[int, RoundRow] = {}
        self._summaries: dict[tuple[str, int, str], SummaryRow] = {}
        self._matches: dict[tuple[int, str, str], MatchRow] = {}
        self._bundles: dict[str, bytes] = {}  # insertion order is age: oldest first
        self._provenance: dict[str, tuple[bytes, bytes]] = {}  # digest -> (signature, signer cert)
        self._reports: dict[tuple[int, str, str, str], ReportRow] = {}
        self._bundle_bytes = 0
        self._compat: dict[tuple[str, str], CompatRow] = {}

    # ----- nodes
    def upsert_node(self, node: NodeRow) -> None:
        row = norm_node(node)
        with self._lock:
            self._nodes[row.node_id] = row

    def get_node(self, node_id: str) -> NodeRow | None:
        node_id = as_str(node_id, "node_id")
        with self._lock:
            row = self._nodes.get(node_id)
            return None if row is None else dataclasses.replace(row)

    def list_nodes(self) -> list[NodeRow]:
        with self._lock:
            return [dataclasses.replace(self._nodes[k]) for k in sorted(self._nodes)]

    # ----- rounds
    def put_round(self, row: RoundRow) -> None:
        new = norm_round(row)
        with self._lock:
            self._rounds[new.round] = new

    def get_round(self, round: int) -> RoundRow | None:
        round = as_int(round, "round")
        with self._lock:
            row = self._rounds.get(round)
            return None if row is None else norm_round(row)

    def latest_round(self) -> int:
        with self._lock:
            return max(self._rounds, default=-1)

    # ----- summaries
    def put_summaries(self, rows: Sequence[SummaryRow], node: NodeRow | None = None) -> tuple[int, int]:
        batch = [norm_summary(r) for r in rows]  # all validated before anything is written
        n = None if node is None else norm_node(node)
        accepted = duplicates = 0
        with self._lock:
            for row in batch:
                key = (row.node_id, row.round, row.prompt_id)
                if key in self._summaries:
                    duplicates += 1
                else:
                    self._summaries[key] = row
                    accepted += 1
            if n is not None:
                self._nodes[n.node_id] = dataclasses.replace(n, published=n.published + accepted)
        return accepted, duplicates

    def summaries(self, round: int | None = None, node_id: str | None = None,
                  prompt_ids: Iterable[str] | None = None, min_round: int | None = None) -> list[SummaryRow]:
        round, min_round = opt_int(round, "round"), opt_int(min_round, "min_round")
        node_id = opt_str(node_id, "node_id")
        wanted = norm_prompt_ids(prompt_ids)
        wanted_set = None if wanted is None else set(wanted)
        with self._lock:
            out = [_copy_summary(r) for r in self._summaries.values()
                   if (round is None or r.round == round)
                   and (node_id is None or r.node_id == node_id)
                   and (wanted_set is None or r.prompt_id in wanted_set)
                   and (min_round is None or r.round >= min_round)]
        out.sort(key=summary_key)
        return out

    def set_bundle_digest(self, node_id: str, round: int, prompt_id: str, digest: str) -> bool:
        key = (as_str(node_id, "node_id"), as_int(round, "round"), as_str(prompt_id, "prompt_id"))
        digest = as_str(digest, "digest")
        with self._lock:
            row = self._summaries.get(key)
            if row is None:
                return False
            row.bundle_digest = digest
            return True

    # ----- matches
    def put_matches(self, rows: Sequence[MatchRow]) -> None:
        batch = [norm_match(r) for r in rows]
        with self._lock:
            for row in batch:
                self._matches.setdefault((row.round, row.receiver, row.prompt_id), row)

    def matches(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[MatchRow]:
        with self._lock:
            out = _filtered(self._matches.values(), round, receiver, source)
        out.sort(key=match_key)
        return out

    # ----- bundles
    def put_bundle(self, digest: str, data: bytes, signature: bytes = b"", signer_cert: bytes = b"") -> bool:
        digest = as_str(digest, "digest")
        blob = norm_bytes(data)
        provenance = (norm_blob(signature, "signature"), norm_blob(signer_cert, "signer_cert"))
        with self._lock:
            if digest in self._bundles:
                return False
            self._bundles[digest] = blob
            self._provenance[digest] = provenance
            self._bundle_bytes += len(blob)
            return True

    def bundle_provenance(self, digest: str) -> tuple[bytes, bytes] | None:
        digest = as_str(digest, "digest")
        with self._lock:
            return self._provenance.get(digest)

    def get_bundle(self, digest: str) -> bytes | None:
        digest = as_str(digest, "digest")
        with self._lock:
            return self._bundles.get(digest)  # bytes are immutable: no copy needed

    def has_bundles(self, digests: Sequence[str]) -> list[str]:
        digests = norm_digests(digests)
        with self._lock:
            return [d for d in digests if d in self._bundles]

    def bundle_stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._bundles), self._bundle_bytes

    # ----- compatibility
    def update_compat(self, source: str, receiver: str, mean_s: float, admitted_fraction: float,
                      rejected: bool) -> None:
        args = norm_compat_args(source, receiver, mean_s, admitted_fraction, rejected)
        with self._lock:
            key = (args[0], args[1])
            self._compat[key] = fold_compat(self._compat.get(key), *args)

    def compat(self) -> list[CompatRow]:
        with self._lock:
            return [dataclasses.replace(self._compat[k]) for k in sorted(self._compat)]

    def put_reports(self, rows: Sequence[ReportRow]) -> tuple[int, int]:
        batch = [norm_report(r) for r in rows]
        accepted = 0
        with self._lock:
            for row in batch:
                key = report_key(row)
                if key in self._reports:
                    continue
                self._reports[key] = row
                pair = (row.source, row.receiver)
                self._compat[pair] = fold_compat(self._compat.get(pair), row.source, row.receiver, row.mean_s,
                                                 row.admitted_fraction, row.rejected)
                accepted += 1
        return accepted, len(batch) - accepted

    def reports(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[ReportRow]:
        with self._lock:
            out = _filtered(self._reports.values(), round, receiver, source)
        out.sort(key=report_key)
        return out

    # ----- retention
    def prune(self, keep_rounds: int | None = None, max_bundle_bytes: int | None = None) -> int:
        check_prune_args(keep_rounds, max_bundle_bytes)
        removed = 0
        with self._lock:
            cutoff = prune_cutoff(self.latest_round(), keep_rounds)
            if cutoff is not None:
                for table, round_of in ((self._summaries, lambda k: k[1]), (self._matches, lambda k: k[0]),
                                        (self._reports, lambda k: k[0]), (self._rounds, lambda k: k)):
                    old = [k for k in table if round_of(k) < cutoff]
                    for k in old:
                        del table[k]
                    removed += len(old)
            drop = bundles_to_drop([(d, len(b)) for d, b in self._bundles.items()], max_bundle_bytes)
            if drop:
                dropped = set(drop)
                for d in drop:
                    self._bundle_bytes -= len(self._bundles.pop(d))
                    del self._provenance[d]
                for row in self._summaries.values():
                    if row.bundle_digest in dropped:
                        row.bundle_digest = ""
                removed += len(drop)
        return removed

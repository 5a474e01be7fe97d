"""In-memory `BrokerState`: dicts behind one re-entrant lock. For tests and for a broker that
does not need to survive a restart.

The row normalisation and arithmetic it shares with `state_sqlite` live in
`graft_fed.broker.state_rows`. See docs/broker-state.md for the contract.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Any, Iterable, Sequence

from graft_fed.broker.state import BrokerState, CompatRow, MatchRow, NodeRow, ReportRow, RoundRow, SummaryRow
from graft_fed.broker.state_rows import (
    as_float, as_int, as_str, bundles_to_drop, check_prune_args, fold_compat, lower_counts, match_key, norm_blob,
    norm_bytes, norm_compat_args, norm_digests, norm_match, norm_node, norm_pairs, norm_prompt_ids, norm_report,
    norm_round, norm_summary, opt_int, opt_str, prune_cutoff, report_key, summary_key,
)


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
        self._secrets: dict[str, str] = {}  # node id -> the hash of the secret that holds it
        self._rounds: dict[int, RoundRow] = {}
        self._summaries: dict[tuple[str, int, str], SummaryRow] = {}
        self._held_by_node: Counter[str] = Counter()  # summaries held per node
        self._uploader: dict[str, str] = {}  # digest -> the node that uploaded it
        self._bundle_bytes_by_node: Counter[str] = Counter()  # bytes of the bundles each uploaded
        self._matches: dict[tuple[int, str, str], MatchRow] = {}
        self._match_sets: dict[int, bytes] = {}
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

    def node_secret(self, node_id: str) -> str:
        node_id = as_str(node_id, "node_id")
        with self._lock:
            return self._secrets.get(node_id, "")

    def set_node_secret(self, node_id: str, secret_hash: str) -> None:
        node_id, secret_hash = as_str(node_id, "node_id"), as_str(secret_hash, "secret_hash")
        with self._lock:
            self._secrets[node_id] = secret_hash

    def record_liveness(self, seen: Sequence[tuple[str, float]]) -> None:
        batch = [(as_str(node_id, "node_id"), as_float(t, "last_seen")) for node_id, t in seen]
        with self._lock:
            for node_id, t in batch:
                node = self._nodes.get(node_id)
                if node is not None and t > node.last_seen:
                    self._nodes[node_id] = dataclasses.replace(node, last_seen=t)

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
                    self._held_by_node[row.node_id] += 1
                    accepted += 1
            if n is not None:
                self._nodes[n.node_id] = dataclasses.replace(n, published=n.published + accepted)
        return accepted, duplicates

    def summaries_held(self, node_id: str) -> int:
        return self._held_by_node.get(node_id, 0)

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

    def put_match_set(self, round: int, data: bytes, round_row: RoundRow | None = None) -> bool:
        round, blob = as_int(round, "round"), norm_blob(data, "match set")
        new = None if round_row is None else norm_round(round_row)
        with self._lock:
            if round in self._match_sets:
                return False
            self._match_sets[round] = blob
            if new is not None:
                self._rounds[new.round] = new
            return True

    def match_set(self, round: int) -> bytes | None:
        round = as_int(round, "round")
        with self._lock:
            return self._match_sets.get(round)

    def match_set_rounds(self) -> list[int]:
        with self._lock:
            return sorted(self._match_sets)

    # ----- bundles
    def put_bundle(self, digest: str, data: bytes, signature: bytes = b"", signer_cert: bytes = b"",
                   node_id: str = "") -> bool:
        digest, node_id = as_str(digest, "digest"), as_str(node_id, "node_id")
        blob = norm_bytes(data)
        provenance = (norm_blob(signature, "signature"), norm_blob(signer_cert, "signer_cert"))
        with self._lock:
            if digest in self._bundles:
                return False
            self._bundles[digest] = blob
            self._provenance[digest] = provenance
            self._bundle_bytes += len(blob)
            if node_id:
                self._uploader[digest] = node_id
                self._bundle_bytes_by_node[node_id] += len(blob)
            return True

    def bundle_bytes_held(self, node_id: str) -> int:
        return self._bundle_bytes_by_node.get(node_id, 0)

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
            self._compat[key] = fold_compat(self._compat.get(key), *args[:2], (args[2:],))

    def compat(self, pairs: Iterable[tuple[str, str]] | None = None) -> list[CompatRow]:
        with self._lock:
            keys = sorted(self._compat) if pairs is None else sorted(set(norm_pairs(pairs)) & self._compat.keys())
            return [dataclasses.replace(self._compat[k]) for k in keys]

    def put_report_batches(self, batches: Sequence[Sequence[ReportRow]]) -> list[tuple[int, int]]:
        normed = [[norm_report(r) for r in rows] for rows in batches]
        with self._lock:
            return [self._put_reports(batch) for batch in normed]

    def _put_reports(self, batch: list[ReportRow]) -> tuple[int, int]:
        accepted = 0
        for row in batch:
            key = report_key(row)
            if key in self._reports:
                continue
            self._reports[key] = row  # norm_report's own copy
            pair = (row.source, row.receiver)
            self._compat[pair] = fold_compat(self._compat.get(pair), row.source, row.receiver,
                                             ((row.mean_s, row.admitted_fraction, row.rejected, row.undelivered),))
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
                named = {row.bundle_digest for key, row in self._summaries.items() if key[1] < cutoff}
                for table, round_of in ((self._summaries, lambda k: k[1]), (self._matches, lambda k: k[0]),
                                        (self._match_sets, lambda k: k),
                                        (self._reports, lambda k: k[0]), (self._rounds, lambda k: k)):
                    old = [k for k in table if round_of(k) < cutoff]
                    for k in old:
                        del table[k]
                    removed += len(old)
                    if table is self._summaries:
                        lower_counts(self._held_by_node, Counter(k[0] for k in old))
                # the bundles only those rounds' summaries named (as SqliteState.prune)
                named -= {row.bundle_digest for row in self._summaries.values()}
                removed += self._drop_bundles([d for d in self._bundles if d in named])
            removed += self._drop_bundles(bundles_to_drop([(d, len(b)) for d, b in self._bundles.items()],
                                                          max_bundle_bytes))
        return removed

    def _drop_bundles(self, drop: list[str]) -> int:
        """Delete bundles (their summaries lose the digest; their uploaders' counts fall), under
        the lock; returns how many."""
        if drop:
            dropped = set(drop)
            for d in drop:
                size = len(self._bundles.pop(d))
                self._bundle_bytes -= size
                del self._provenance[d]
                owner = self._uploader.pop(d, "")
                if owner:
                    lower_counts(self._bundle_bytes_by_node, {owner: size})
            for row in self._summaries.values():
                if row.bundle_digest in dropped:
                    row.bundle_digest = ""
        return len(drop)

"""Broker state behind one abstract interface, with its contract.

Contract every implementation keeps (tests/broker/test_state.py runs the same suite on
each implementation):

- Every mutating method is atomic: it either applies completely or not at all, and a
  method that raises leaves the state exactly as it was.
- Writes are durable when the method returns (for persistent implementations): a crash
  after `put_summaries`, `put_bundle`, `put_matches`, `put_match_set` or `update_compat` returned loses
  nothing; a crash before leaves no partial write.
- `put_summaries` is idempotent on (node_id, round, prompt_id): a retried publish never
  duplicates; the first write wins and later ones are counted as duplicates.
- `put_match_set` is idempotent on the round: the first set stored wins.
- `put_bundle` is idempotent on the digest; the bytes, and the provenance (the producing
  node's signature and certificate) that came with them, are stored once: the first
  upload wins. A bundle written a chunk at a time (`begin_bundle`) is the same: nothing of
  it is held before its `commit`, which is then durable and idempotent as put_bundle.
- `put_reports` is idempotent on (round, receiver, source, prompt_id): a receiver's
  report about one group counts once towards the pair's compatibility, however often it
  is sent (a retried or replayed report changes nothing).
- Reads return copies: mutating a returned object never changes the state.
- Methods are safe to call from several threads.
- A state belongs to one federation: `bind_manifest` stores the identifying fields of the
  broker's manifest (MANIFEST_FIELDS) the first time, and refuses (DataError) a later
  broker whose manifest differs in any of them, changing nothing.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

from graft_fed.errors import DataError
from graft_fed.federation.messages import SummaryRow
from graft_fed.federation.summaryblock import SummaryBlock

NODE_STATES = ("registered", "online", "offline", "left")

log = logging.getLogger("graft_fed.broker")

#: The manifest's fields a state's rows are bound to (`BrokerState.bind_manifest`): those that
#: make stored rows meaningless, or dangerous, under another value: whose federation it is,
#: which problems the prompt ids name (dataset id and hash) and which of them a round asks
#: (seed, prompts per round), how many responses a group holds (n), what its rewards mean
#: (the verifier) and how its bundles' advantages were normalised (advantage). Not the
#: operator's knobs (mode, staleness, deadlines, limits), nor versions an upgrade changes
#: (protocol, the verifier's package version): those may change between two starts.
MANIFEST_FIELDS = ("federation_id", "dataset_id", "dataset_hash", "seed", "n", "prompts_per_round",
                   "verifier_name", "advantage")


@dataclass
class NodeRow:
    node_id: str
    model_id: str
    tokenizer_id: str
    privacy: str  # share_all | matched_only | summaries_only
    state: str  # one of NODE_STATES
    session_id: str
    round: int  # the node's last reported round
    last_seen: float  # unix time of the last call
    published: int = 0


class SummaryHead(NamedTuple):
    """What matching and offers read of a summary: no per-response lists to decode."""

    node_id: str
    round: int
    prompt_id: str
    n: int
    k: int
    bundle_digest: str


@dataclass
class MatchRow:
    round: int
    receiver: str
    prompt_id: str
    source: str
    source_round: int


@dataclass
class CompatRow:
    source: str
    receiver: str
    groups: int  # reports received for this pair
    mean_s: float  # running mean of the reported mean s
    admitted_fraction: float  # running mean of the reported admitted fraction
    rejected: int  # groups rejected by re-verification
    #: of `groups`, those the receiver never received (reported undelivered): they weigh in
    #: mean_s (as 0) but not in the source's quarantine rate
    undelivered: int = 0


@dataclass(slots=True)
class ReportRow:
    """One receiver's verdict on one group it was given: what ReportCompatibility carries."""

    round: int  # the receiver's round
    receiver: str
    source: str
    prompt_id: str
    mean_s: float
    admitted_fraction: float
    rejected: bool  # re-verification (or the bundle's signature) failed
    undelivered: bool = False  # the group never arrived (mean_s and admitted_fraction 0, not rejected)


class ReportRows(Sequence[ReportRow]):
    """One receiver's report of one round as columns: the sequence of its ReportRow, made
    only as they are read. A report of a thousand groups waits for its commit (and a
    commit of twenty reports takes a few hundred milliseconds) holding a few lists rather
    than a thousand objects the garbage collector tracks: at 64 x 4,096 those kept the
    collector's oldest generation growing, and it ran a full collection (up to 53 ms with
    the interpreter held) three times a round while nodes reported (issue 13,
    docs/performance.md, fortieth pass)."""

    __slots__ = ("round", "receiver", "sources", "prompt_ids", "mean_s", "admitted_fraction", "rejected",
                 "undelivered")

    def __init__(self, round: int, receiver: str, sources: list[str], prompt_ids: list[str], mean_s: list[float],
                 admitted_fraction: list[float], rejected: list[bool], undelivered: list[bool] | None = None) -> None:
        if undelivered is None:
            undelivered = [False] * len(sources)
        if not (len(sources) == len(prompt_ids) == len(mean_s) == len(admitted_fraction) == len(rejected)
                == len(undelivered)):
            raise ValueError("a report's columns differ in length")
        self.round, self.receiver = round, receiver
        self.sources, self.prompt_ids, self.mean_s = sources, prompt_ids, mean_s
        self.admitted_fraction, self.rejected, self.undelivered = admitted_fraction, rejected, undelivered

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - an index or a slice, as a list's
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return ReportRow(self.round, self.receiver, self.sources[i], self.prompt_ids[i], self.mean_s[i],
                         self.admitted_fraction[i], self.rejected[i], self.undelivered[i])

    def __iter__(self) -> Iterator[ReportRow]:
        for s, p, m, a, r, u in zip(self.sources, self.prompt_ids, self.mean_s, self.admitted_fraction, self.rejected,
                                    self.undelivered):
            yield ReportRow(self.round, self.receiver, s, p, m, a, r, u)

    def without(self, drop: set[tuple[str, str]]) -> "ReportRows":
        """The rows whose (source, prompt id) is not in `drop`."""
        keep = [i for i, key in enumerate(zip(self.sources, self.prompt_ids)) if key not in drop]
        return ReportRows(self.round, self.receiver, *([col[i] for i in keep] for col in (
            self.sources, self.prompt_ids, self.mean_s, self.admitted_fraction, self.rejected, self.undelivered)))


@dataclass
class RoundRow:
    round: int
    state: str  # open | matched
    opened_at: float
    matched_at: float | None = None
    # Nodes included when the round was matched; a node publishing to the round later
    # (a late joiner learning from stored groups) is matched on its own.
    participants: list[str] = field(default_factory=list)


class BrokerState(abc.ABC):
    # ----- nodes
    @abc.abstractmethod
    def upsert_node(self, node: NodeRow) -> None: ...

    @abc.abstractmethod
    def get_node(self, node_id: str) -> NodeRow | None: ...

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRow]: ...

    @abc.abstractmethod
    def node_secret(self, node_id: str) -> str:
        """The hash of the secret that holds `node_id` (sessions.py, Join), "" when none does."""

    @abc.abstractmethod
    def set_node_secret(self, node_id: str, secret_hash: str) -> None:
        """Store the hash of the secret that holds `node_id` (replacing any), durably."""

    def record_liveness(self, seen: Sequence[tuple[str, float]]) -> None:
        """Set `last_seen` of the named nodes (at least to the given time: a row that is
        already later keeps its time), atomically; unknown nodes are skipped. Nothing else of
        the rows changes. This default is atomic only for one writer; implementations do it in
        one transaction."""
        for node_id, last_seen in seen:
            node = self.get_node(node_id)
            if node is not None and last_seen > node.last_seen:
                self.upsert_node(NodeRow(**{**node.__dict__, "last_seen": last_seen}))

    # ----- rounds
    @abc.abstractmethod
    def put_round(self, row: RoundRow) -> None:
        """Insert or replace a round's row."""

    @abc.abstractmethod
    def get_round(self, round: int) -> RoundRow | None: ...

    @abc.abstractmethod
    def latest_round(self) -> int:
        """The highest round with a row, or -1."""

    # ----- summaries
    @abc.abstractmethod
    def put_summaries(self, rows: Sequence[SummaryRow], node: NodeRow | None = None) -> tuple[int, int]:
        """Store summaries; returns (accepted, duplicates). Idempotent on (node, round, prompt).

        `node`, when given, is stored in the same transaction with `published` increased by the
        number accepted, so a crash never leaves the count out of step with the summaries."""

    def put_summary_block(self, block: SummaryBlock, node: NodeRow | None = None) -> tuple[int, int]:
        """`put_summaries` for one publish as columns (graft_fed/federation/summaryblock.py):
        the same result and the same idempotence. This default turns the block into rows;
        SQLite stores it as one blob."""
        if not isinstance(block, SummaryBlock):
            raise TypeError(f"expected a SummaryBlock, got {type(block).__name__}")
        return self.put_summaries(block.rows(), node=node)

    def put_summary_blocks(self, items: Sequence[tuple[SummaryBlock, NodeRow | None]]
                           ) -> list[tuple[int, int] | Exception]:
        """`put_summary_block` for several publishes at once, each of another node: for each,
        (accepted, duplicates) or the exception it failed with; one that fails does not stop
        the others. This default stores them one by one; SQLite stores them in one commit."""
        out: list[tuple[int, int] | Exception] = []
        for block, node in items:
            try:
                out.append(self.put_summary_block(block, node=node))
            except Exception as exc:  # noqa: BLE001 - each publish its own outcome
                out.append(exc)
        return out

    @abc.abstractmethod
    def summaries(self, round: int | None = None, node_id: str | None = None,
                  prompt_ids: Iterable[str] | None = None, min_round: int | None = None) -> list[SummaryRow]:
        """Summaries filtered by exact round, node, prompt ids and/or a minimum round."""

    def summary_heads(self, round: int | None = None, node_id: str | None = None,
                      prompt_ids: Iterable[str] | None = None, min_round: int | None = None) -> list[SummaryHead]:
        """`summaries` without the per-response lists (same filters, same order). This default
        reads whole rows; implementations may read only the head columns."""
        return [SummaryHead(s.node_id, s.round, s.prompt_id, s.n, s.k, s.bundle_digest)
                for s in self.summaries(round=round, node_id=node_id, prompt_ids=prompt_ids, min_round=min_round)]

    @abc.abstractmethod
    def summaries_held(self, node_id: str) -> int:
        """How many summaries of `node_id` the state holds: raised by each new one stored
        (not by a duplicate), lowered by retention, counted again when the state is opened.
        What the broker's per-node quota (`max_node_summaries`) counts. Answered from memory,
        without waiting for a commit under way: a count at most one commit old."""

    @abc.abstractmethod
    def set_bundle_digest(self, node_id: str, round: int, prompt_id: str, digest: str) -> bool:
        """Attach an uploaded bundle to its summary; False when no such summary exists."""

    # ----- matches
    @abc.abstractmethod
    def put_matches(self, rows: Sequence[MatchRow]) -> None:
        """Store a round's matches (idempotent on (round, receiver, prompt))."""

    @abc.abstractmethod
    def matches(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[MatchRow]:
        """Matches stored as rows (`put_matches`; a round's match set is separate)."""

    def has_matches(self, round: int) -> bool:
        """Whether `round` has any match stored as a row (what `matches(round=round)` would
        find something in); implementations may answer without reading the rows."""
        return bool(self.matches(round=round))

    @abc.abstractmethod
    def put_match_set(self, round: int, data: bytes, round_row: RoundRow | None = None) -> bool:
        """Store a synchronous round's whole matching as one opaque blob (the encoding of
        graft_fed/broker/matchset.py: one write instead of a row per match). The first set
        stored for a round wins; False when the round already has one (nothing rewritten).
        With `round_row` (the round, matched), that row is written with the set, in the same
        transaction, when the set is stored, and not at all when it is not."""

    @abc.abstractmethod
    def match_set(self, round: int) -> bytes | None:
        """The round's stored match set, None when it has none."""

    @abc.abstractmethod
    def match_set_rounds(self) -> list[int]:
        """Rounds that have a match set, ascending."""

    def matched_heads(self, round: int, receiver: str | None = None,
                      source: str | None = None) -> list[tuple[MatchRow, SummaryHead]]:
        """The round's matches (filtered like `matches`, same order), each with the head of
        the source summary it names; a match whose summary is gone (pruned) is left out. This
        default reads the summaries per (source, round); implementations may join."""
        matches = self.matches(round=round, receiver=receiver, source=source)
        wanted: dict[tuple[str, int], set[str]] = {}
        for m in matches:
            wanted.setdefault((m.source, m.source_round), set()).add(m.prompt_id)
        heads = {}
        for (src, rnd), pids in wanted.items():
            for h in self.summary_heads(round=rnd, node_id=src, prompt_ids=sorted(pids)):
                heads[(h.node_id, h.round, h.prompt_id)] = h
        return [(m, heads[(m.source, m.source_round, m.prompt_id)]) for m in matches
                if (m.source, m.source_round, m.prompt_id) in heads]

    # ----- bundles (content-addressed)
    def begin_bundle(self) -> "BundleWriter":
        """A bundle arriving a chunk at a time (an upload): its bytes are written as they come
        and become a bundle, held and durable, only at `BundleWriter.commit`."""
        return BundleWriter(self)

    @abc.abstractmethod
    def put_bundle(self, digest: str, data: bytes, signature: bytes = b"", signer_cert: bytes = b"",
                   node_id: str = "") -> bool:
        """Store bytes under their sha256 digest, with the producer's signature over the digest
        and its certificate (DER) when it signed, uploaded by `node_id` ("" for none: they
        count against no node's quota, `bundle_bytes_held`); False when already held (then
        nothing, provenance and uploader included, is rewritten). The caller has checked the
        digest."""

    @abc.abstractmethod
    def get_bundle(self, digest: str) -> bytes | None: ...

    @abc.abstractmethod
    def bundle_provenance(self, digest: str) -> tuple[bytes, bytes] | None:
        """(signature, signer certificate DER) stored with a bundle, (b"", b"") when it came
        unsigned, None when the bundle is not held."""

    def read_bundle(self, digest: str, offset: int, length: int) -> bytes | None:
        """Up to `length` bytes of a bundle from `offset` (b"" past its end), None when the
        bundle is not held: what a fetch streams, one chunk at a time. This default reads the
        whole blob; implementations read only the chunk."""
        data = self.get_bundle(digest)
        return None if data is None else data[offset:offset + length]

    def iter_bundle(self, digest: str, chunk: int) -> Iterator[bytes] | None:
        """The bundle's bytes in chunks of at most `chunk` bytes (one empty
        chunk for an empty bundle), None when not held. The chunks are those of the bundle
        as it was when the iteration started, even if it is pruned meanwhile. This default
        slices the whole blob (fine for an in-memory state, which holds it anyway);
        implementations on disk read one chunk at a time."""
        data = self.get_bundle(digest)
        if data is None:
            return None
        return iter([data[off:off + chunk] for off in range(0, max(1, len(data)), chunk)])

    def bundle_file(self, digest: str) -> tuple[str, int] | None:
        """(path, size) of a bundle whose bytes are a file of their own, which a reader may
        open itself (the front process streams a fetch from it: broker/front.py); None when
        not held, or not held as such a file (this default: an in-memory state has none).
        The file is immutable and named by its digest: opened later, it holds the same bytes
        or is gone (retention)."""
        return None

    def bundle_file_error(self, digest: str, outcome: str, reason: str = "") -> Exception:
        """The error a fetch ends with when another process could not send all of the file
        `bundle_file` named: `outcome` "missing" (no such file), "short" (fewer bytes than the
        row's size) or "failed" (`reason`, the read's error). Only for states whose
        `bundle_file` names files; this default names none."""
        raise NotImplementedError("this state holds no bundle as a file of its own")

    def bundle_held_at_open(self, digest: str) -> bool:
        """Whether a held bundle was stored before this state was opened (by an earlier
        broker, or in a restored backup): this process did not hash its bytes on their way
        in. False for a bundle not held, and for a state that starts empty (this default)."""
        return False

    def bundle_size(self, digest: str) -> int | None:
        """A held bundle's size in bytes, None when not held."""
        data = self.get_bundle(digest)
        return None if data is None else len(data)

    @abc.abstractmethod
    def has_bundles(self, digests: Sequence[str]) -> list[str]:
        """The subset of `digests` held, in input order."""

    @abc.abstractmethod
    def bundle_stats(self) -> tuple[int, int]:
        """(number of bundles, total bytes)."""

    @abc.abstractmethod
    def bundle_bytes_held(self, node_id: str) -> int:
        """Bytes of the bundles `node_id` uploaded (it stored first) that the state still
        holds: raised by each one stored, lowered when retention drops one, counted again
        when the state is opened. What the broker's per-node quota (`max_node_bundle_mib`)
        counts. Answered from memory, without waiting for a commit under way."""

    # ----- compatibility
    @abc.abstractmethod
    def update_compat(self, source: str, receiver: str, mean_s: float, admitted_fraction: float,
                      rejected: bool) -> None:
        """Fold one receiver report into the pair's running means (plain running mean over
        reports) and rejection count. A rejected report counts only towards `rejected`."""

    @abc.abstractmethod
    def compat(self, pairs: Iterable[tuple[str, str]] | None = None) -> list[CompatRow]:
        """Every pair's row, by (source, receiver); with `pairs`, the rows of those
        (source, receiver) pairs that have one (what a report's fold changed)."""

    def put_reports(self, rows: Sequence[ReportRow]) -> tuple[int, int]:
        """Store receiver reports and fold each new one into its pair's compatibility
        (exactly as `update_compat`), atomically; returns (accepted, duplicates). Idempotent
        on (round, receiver, source, prompt_id): the first report wins."""
        return self.put_report_batches([rows])[0]

    @abc.abstractmethod
    def put_report_batches(self, batches: Sequence[Sequence[ReportRow]]) -> list[tuple[int, int]]:
        """`put_reports` of each batch in turn, all in one transaction (one commit for the
        reports that arrived together); (accepted, duplicates) per batch. Nothing is stored
        when any batch is malformed."""

    @abc.abstractmethod
    def reports(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[ReportRow]:
        """Stored reports, by (round, receiver, source, prompt_id)."""

    # ----- retention
    @abc.abstractmethod
    def prune(self, keep_rounds: int | None = None, max_bundle_bytes: int | None = None) -> int:
        """Drop summaries, matches, reports and rounds older than the newest `keep_rounds` rounds, and
        the oldest bundles beyond `max_bundle_bytes` (their summaries lose the digest);
        returns the number of rows removed."""

    def close(self) -> None:
        """Release resources (files, connections)."""

    # ----- the federation the rows belong to
    def bind_manifest(self, manifest: Any) -> None:
        """Bind the state to the federation of `manifest` (a federation.manifest.Manifest, or
        anything with its MANIFEST_FIELDS): stored the first time; afterwards a manifest that
        differs in any of those fields raises DataError naming each (stored and configured
        values), and nothing is changed. A state that holds rows but no manifest (written by a
        graft-fed from before this check) adopts this one, and says so in the log; a field
        added to MANIFEST_FIELDS since the manifest was stored is adopted likewise."""
        wanted = {f: getattr(manifest, f) for f in MANIFEST_FIELDS}
        stored = self._stored_manifest()
        if stored is None:
            if self._holds_rows():
                log.info("%s holds rows but no manifest (written before graft-fed stored one): it adopts this "
                         "broker's: %s", self._state_name(),
                         ", ".join(f"{k}={v!r}" for k, v in wanted.items()))
            self._store_manifest(wanted)
            return
        diffs = [f"{f}: the state has {stored[f]!r}, the configuration {wanted[f]!r}"
                 for f in MANIFEST_FIELDS if f in stored and stored[f] != wanted[f]]
        if diffs:
            raise DataError(
                f"{self._state_name()} belongs to another federation than this broker's configuration ("
                + "; ".join(diffs) + "). Its rows (nodes, rounds, summaries, matches, bundles) would be mixed "
                "with this federation's, so the broker does not start and its rows were left as they were. "
                "Point the broker's db at this federation's own state (or at a new path, to start with an empty "
                "state), or put the configuration back if it is what changed by mistake")
        added = {f: v for f, v in wanted.items() if f not in stored}
        if added:
            log.info("%s: manifest field(s) stored for the first time: %s", self._state_name(),
                     ", ".join(f"{k}={v!r}" for k, v in added.items()))
            self._store_manifest({**stored, **added})

    def _state_name(self) -> str:
        return "broker state (in memory)"

    def _stored_manifest(self) -> dict[str, Any] | None:
        """The manifest fields bound so far, or None. This default keeps them in the object."""
        got = getattr(self, "_bound_manifest", None)
        return None if got is None else dict(got)

    def _store_manifest(self, fields: dict[str, Any]) -> None:
        self._bound_manifest = dict(fields)

    def _holds_rows(self) -> bool:
        return self.latest_round() >= 0 or bool(self.list_nodes()) or self.bundle_stats()[0] > 0


class BundleWriter:
    """The bytes of one bundle on their way into a state (`BrokerState.begin_bundle`). None
    of them is a bundle, seen by any reader, before `commit` returns; `abort` drops them,
    and so does a commit that finds the digest held (the first upload wins, as with
    put_bundle). This default keeps the chunks in memory and commits them with put_bundle
    (what an in-memory state does anyway); a state on disk writes each chunk as it comes, so
    memory per upload is bounded by the chunk."""

    def __init__(self, state: BrokerState) -> None:
        self._state = state
        self._chunks: list[bytes] = []
        self.size = 0

    def write(self, data: bytes) -> None:
        self._chunks.append(bytes(data))
        self.size += len(data)

    def prepare(self, digest: str) -> None:
        """Make the bytes written durable under `digest` ahead of `commit`, outside the locks
        the caller takes around it (a state on disk syncs its file here); they are still no
        bundle until `commit`, and `abort` drops them. This default does nothing."""

    def commit(self, digest: str, signature: bytes = b"", signer_cert: bytes = b"", node_id: str = "") -> bool:
        """Store the bytes written under `digest` (the caller checked it), uploaded by
        `node_id`, as put_bundle does; False when the digest was held already (the bytes
        written are dropped)."""
        data, self._chunks = b"".join(self._chunks), []
        return self._state.put_bundle(digest, data, signature=signature, signer_cert=signer_cert, node_id=node_id)

    def commit_attached(self, digest: str, signature: bytes, signer_cert: bytes, node_id: str, round: int,
                        prompt_id: str) -> tuple[bool, bool]:
        """`commit`, then the digest attached to the node's summary of the prompt in the round
        (`set_bundle_digest`): (stored, attached). A state on disk does both in one commit,
        the one an upload waits for. The bundle counts as the node's upload. Nothing is stored
        when the summary is no longer held (retention dropped its round while the bytes
        arrived): (False, False)."""
        if not self._state.summaries(round=round, node_id=node_id, prompt_ids=[prompt_id]):
            self.abort()
            return False, False
        stored = self.commit(digest, signature, signer_cert, node_id=node_id)
        return stored, self._state.set_bundle_digest(node_id, round, prompt_id, digest)

    def abort(self) -> None:
        """Drop what was written (nothing is stored); a no-op after commit."""
        self._chunks = []

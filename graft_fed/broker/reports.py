"""Compatibility reports: a receiver's verdicts on the groups it was offered, folded once per
group into the compatibility matrix (which quarantine reads, broker/quarantine.py); a
rejection of a group the broker re-verifies as correct is not counted."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from typing import Iterable, Sequence

from graft_fed.broker.context import Context, Part
from graft_fed.broker.matcher import Matcher
from graft_fed.broker.state import MatchRow, ReportRow, ReportRows
from graft_fed.federation.bundles import decode_bundle
from graft_fed.federation.errors import FailedPrecondition, InvalidArgument
from graft_fed.federation.limits import MAX_PER_ROUND_FACTOR, MAX_REPORT_MEAN_S, clip
from graft_fed.federation.messages import ReportColumns, ReportEntry, ReportReader, undelivered_but_scored

log = logging.getLogger("graft_fed.broker")


class _Queued:
    """A report waiting for its commit, and what the commit made of it."""

    __slots__ = ("rows", "done", "result", "error")

    def __init__(self, rows: Sequence[ReportRow]) -> None:
        self.rows = rows
        self.done = False
        self.result = (0, 0)
        self.error: BaseException | None = None


class Reports(Part):
    def __init__(self, ctx: Context, matcher: Matcher) -> None:
        super().__init__(ctx)
        self.matcher = matcher
        self._verifier = None
        self._verifier_failed = False
        self._verifier_lock = threading.Lock()
        self._fold = threading.Lock()  # one commit of reports (and its read-back) at a time
        self._queue: list[_Queued] = []  # reports waiting for the next commit
        self._queue_lock = threading.Lock()

    def report(self, node_id: str, session_id: str, round: int,
               entries: Iterable[ReportEntry] | ReportReader) -> tuple[int, int]:
        """Fold a receiver's verdicts into the compatibility matrix; returns (accepted,
        duplicates). A report about one group, (round, receiver, source, prompt), counts
        once however often it is sent: a retried or replayed report changes nothing, and a
        receiver cannot inflate a source's rejections by repeating one. A rejection of a
        group the broker holds and re-verifies as correct is not counted (`recheck_rejections`)."""
        # the session first (read only; `touch` below checks it again under the lock): a
        # caller without one is told to join, whatever else is wrong with its report
        self.registry.check(node_id, session_id)
        # a work slot, like publishes and answers, so that a few report threads at a time
        # want the interpreter; `entries` may be lazy (the servicer's are made as they are
        # read, and checked against the uniform bounds), so they are read in here too: the
        # entries' checks in every reporting thread at once, outside any slot, had heartbeats
        # wait 400-700 ms while 64 nodes reported 1,229 groups each (issue 13,
        # docs/performance.md, thirty-seventh and thirty-eighth passes)
        with self.work:
            limit = self.manifest.prompts_per_round * MAX_PER_ROUND_FACTOR
            # no more read than refused; as columns, no object per entry (the codec's reader,
            # `columns`), or any iterable of ReportEntry, counted before any is read
            read = entries.columns(limit) if isinstance(entries, ReportReader) else \
                list(itertools.islice(entries, limit + 1))
            if len(read if isinstance(read, list) else read.sources) > limit:
                # a receiver gets at most one group per prompt of its round
                raise InvalidArgument(f"more than {limit} entries in one report; at most {limit} (one per group "
                                      "received)")
            cols = ReportColumns.of(read) if isinstance(read, list) else read
            # the report as columns (state.ReportRows), a rejected group's mean_s 0
            rows = ReportRows(round, node_id, cols.sources, cols.prompt_ids,
                              [0.0 if r else m for m, r in zip(cols.mean_s, cols.rejected)], cols.admitted_fraction,
                              cols.rejected, cols.undelivered)
            del cols
            for source, prompt, m, a, r, u in zip(rows.sources, rows.prompt_ids, rows.mean_s, rows.admitted_fraction,
                                                  rows.rejected, rows.undelivered):
                if u and undelivered_but_scored(m, a, r, u):  # only an undelivered group can be both
                    raise InvalidArgument(f"the group of {clip(source)} for prompt {clip(prompt)} is reported "
                                          "undelivered and scored: an undelivered group has mean_s and "
                                          "admitted_fraction 0 and is not rejected")
            for mean_s, admitted in zip(rows.mean_s, rows.admitted_fraction):  # 0 where rejected
                if not (math.isfinite(mean_s) and 0 <= mean_s <= MAX_REPORT_MEAN_S):
                    raise InvalidArgument(f"mean_s must be a finite number in [0, {MAX_REPORT_MEAN_S:g}], got {mean_s}")
                if not (0.0 <= admitted <= 1.0):
                    raise InvalidArgument(f"admitted_fraction must be in [0, 1], got {admitted}")
            keys = list(zip(rows.sources, rows.prompt_ids))
            if len(set(keys)) < len(keys):
                seen: set[tuple[str, str]] = set()
                source, prompt = next(k for k in keys if k in seen or seen.add(k))
                raise InvalidArgument(f"source {clip(source)} and prompt {clip(prompt)} appear twice in one "
                                      "report; send one entry per group received")
            with self.cond:
                self.registry.touch(node_id, session_id)
                if not self.rounds.may_claim(node_id, round):
                    raise FailedPrecondition(f"report for round {round}, implausibly far ahead of the federation "
                                             f"(at most {self.rounds.claim_limit(node_id)} for {clip(node_id)})")
                for source in set(rows.sources):
                    if source == node_id or self.registry.get(source) is None:
                        raise InvalidArgument(f"unknown source node {clip(source)}")
                # a receiver reports only on groups it was matched to: otherwise one node could
                # invent rejections of an honest source's groups and push it into quarantine
                offered = self.matcher.offered(round, node_id)
                if not offered.issuperset(keys):
                    source, prompt = next(k for k in keys if k not in offered)
                    raise FailedPrecondition(f"{clip(node_id)} was not matched to {clip(source)}'s group for "
                                             f"prompt {clip(prompt)} in round {round}; report only the groups "
                                             "the broker offered you, with the round they were offered in")
                # the matches themselves only where a rejection may be re-verified
                matched = {(m.source, m.prompt_id): m for m in self.matcher.matches_of(round, node_id)} if any(
                    rows.rejected) else {}
        # outside the slot: re-verifying may take a while and needs nothing the lock guards
        disputed = {key for key, rejected in zip(keys, rows.rejected)
                    if rejected and self._rejection_disputed(matched[key])}
        del keys, matched
        if disputed:
            self.counters["disputed_rejections"] += len(disputed)
            log.warning("receiver %s reported %d group(s) rejected that the broker re-verified as correct or "
                        "that their source never uploaded; those rejections are not counted", clip(node_id),
                        len(disputed))
            rows = rows.without(disputed)
        return self._commit(rows)

    def _commit(self, rows: Sequence[ReportRow]) -> tuple[int, int]:
        """Store a report and fold it, as one of the reports that arrived together: group
        commit. Not under the broker's lock (publishes, matching and answers never wait
        behind a report's commit). Whoever takes `_fold` first stores every report queued by
        then in one transaction (one fsync where a thousand nodes report at once), reads
        their pairs back and hands the copy in memory what the state now holds; the others
        find theirs done. One commit at a time, so the copy takes the pairs in the order the
        state folded them."""
        mine = _Queued(rows)
        with self._queue_lock:
            self._queue.append(mine)
        with self._fold:
            if not mine.done:
                with self.work:
                    self._commit_queued()
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _commit_queued(self) -> None:
        """Commit every queued report (the caller holds `_fold` and a work slot). Once a
        report is stored it succeeds, whatever fails after: its node must not resend what
        counts once, and the copy in memory is refreshed or dropped."""
        with self._queue_lock:
            batch, self._queue = self._queue, []
        commits = 0
        try:
            for q, result in zip(batch, self.state.put_report_batches([q.rows for q in batch])):
                q.result = result
            commits = 1
        except (TypeError, ValueError) as exc:  # a malformed report; the state stored nothing
            if len(batch) == 1:
                batch[0].error = exc
            else:  # each alone, so that only that one fails
                for q in batch:
                    try:
                        q.result = self.state.put_reports(q.rows)
                        commits += 1
                    except BaseException as one:  # noqa: BLE001 - that report's own error
                        q.error = one
        except BaseException as exc:  # the commit failed: nothing stored, every report gets its error
            for q in batch:
                q.error = exc
        stored = [q for q in batch if q.error is None]
        for q in batch:
            q.done = True  # read by the others once this thread lets go of `_fold`
        if not stored:
            return
        self.counters["reports"] += sum(q.result[0] for q in stored)
        self.counters["duplicate_reports"] += sum(q.result[1] for q in stored)
        self.counters["report_commits"] += commits
        self.counters["report_calls"] += len(stored)
        if any(q.result[0] for q in stored):
            self._read_back(set().union(*(_pairs(q.rows) for q in stored)))
        total = self.ctx.compat.loaded_rejected_total()
        if total is not None:
            # counted once per group, like the matrix (a repeated rejection is a duplicate)
            self.counters["rejected_groups"] = total

    def _read_back(self, pairs: set[tuple[str, str]]) -> None:
        """Hand the copy in memory the stored rows of `pairs`; when that fails, drop the copy
        (read whole on its next use)."""
        try:
            self.ctx.compat.update(self.state.compat(pairs=pairs))
        except Exception as exc:  # noqa: BLE001 - a storage error; the commit stands
            log.warning("could not read back the compatibility rows of %d pairs (%s); the broker reads them all "
                        "again when it next needs them", len(pairs), exc)
            self.ctx.compat.forget()

    def _rejection_disputed(self, match: MatchRow) -> bool:
        """True when a receiver's claim that the matched group failed re-verification is
        false: the source never uploaded the group (its summary carries no digest, so the
        receiver cannot have fetched it, and a receiver reports a group it did not get as
        undelivered, never as rejected; reported before the upload, the rejection could
        otherwise never be re-checked), or the broker holds the bundle and its own
        re-verification (the federation's verifier, the dataset's answer) agrees with the
        claimed rewards. False when the broker cannot check (the summary or the bundle
        pruned, no verifier, the check failed)."""
        summary = self.ctx.summary(match.source, match.source_round, match.prompt_id)
        if summary is not None and not summary.bundle_digest:
            return True
        if not self.cfg.recheck_rejections:
            return False
        prompt = self.prompts_by_id.get(match.prompt_id)
        if summary is None or prompt is None:
            return False
        data = self.state.get_bundle(summary.bundle_digest)
        if data is None:
            return False
        try:
            rec = decode_bundle(data, summary.bundle_digest)
            verifier = self._get_verifier()
            if verifier is None:
                return False
            scored = verifier.score(list(rec.texts), [prompt.answer] * rec.n).rewards
        except Exception as exc:  # noqa: BLE001 - a check the broker cannot make counts the claim
            log.warning("could not re-verify %s's group for %s: %s", match.source, clip(match.prompt_id), exc)
            return False
        return [float(r) for r in scored] == [float(r) for r in rec.rewards]

    def _get_verifier(self):  # noqa: ANN202 - graft_fed.rewards.verifier.Verifier, imported lazily
        with self._verifier_lock:
            if self._verifier is None and not self._verifier_failed:
                try:
                    from graft_fed.rewards.verifier import build_verifier

                    self._verifier = build_verifier(self.cfg.verifier)
                except Exception as exc:  # noqa: BLE001 - the broker works without it
                    log.warning("the broker cannot load the verifier %s (%s): rejections are counted as "
                                "reported, unchecked", self.cfg.verifier.name, exc)
                    self._verifier_failed = True
            return self._verifier


def _pairs(rows: Sequence[ReportRow]) -> set[tuple[str, str]]:
    """The (source, receiver) pairs a report is about (of a ReportRows, from its columns)."""
    if isinstance(rows, ReportRows):
        return {(source, rows.receiver) for source in set(rows.sources)}
    return {(r.source, r.receiver) for r in rows}

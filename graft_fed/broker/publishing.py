"""Publishing: a node's summaries of a round, validated whole (row by row, or on a block's
columns at once), stored durably, then made visible to matching through the round index."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from graft_fed.broker.context import Context, Part
from graft_fed.broker.publishqueue import PublishQueue
from graft_fed.broker.ratelimit import PublishRateLimit, QuotaWarnings
from graft_fed.broker.state import RoundRow
from graft_fed.federation.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from graft_fed.federation.limits import MAX_ID_LEN, MAX_PER_ROUND_FACTOR, MAX_ROUNDS_AHEAD, MIN_MEAN_LOGPROB, clip
from graft_fed.federation.messages import SummaryRow
from graft_fed.federation.summaryblock import SummaryBlock, facts_of

log = logging.getLogger("graft_fed.broker")

MAX_SUMMARIES_FACTOR = MAX_PER_ROUND_FACTOR  # a round may carry up to 4x prompts_per_round summaries (DAPO refills)


@dataclass(frozen=True)
class Publish:
    """One node's checked publish of a round, as `Publishing.publish_many` stores it."""

    node_id: str
    session_id: str
    round: int
    block: SummaryBlock


@functools.lru_cache(maxsize=8)
def _reward_tables(n: int) -> tuple[np.ndarray, ...]:
    """By k in 0..n: reward_mean k/n; the population std of k ones and n - k zeros and its
    tolerance; the sample std (as federation.messages.summarise computes it) and its
    tolerance. A claimed reward_std is accepted within either tolerance of either std; both
    the row and the column checks read these tables."""
    p = np.arange(n + 1) / n
    var = p * (1 - p)
    pop = np.sqrt(var)
    sample = np.sqrt(var * n / (n - 1)) if n > 1 else np.zeros_like(var)
    return p, pop, 1e-6 * np.maximum(1.0, pop), sample, 1e-6 * np.maximum(1.0, sample)


def _within(a: np.ndarray, lo: float, hi: float | None) -> bool:
    """Every value of the column in [lo, hi] (no upper bound when hi is None); False when one
    is NaN (the minimum and the maximum are NaN then)."""
    if not a.size:
        return True
    if a.dtype.kind in "iu":  # no NaN: nothing for errstate to silence
        return bool((lo <= 0 and a.dtype.kind == "u" or lo <= a.min()) and (hi is None or a.max() <= hi))
    with np.errstate(invalid="ignore"):
        return bool(lo <= a.min() and (hi is None or a.max() <= hi))


@dataclass(frozen=True)
class Received:
    """A publish as received: `prepare()` (run in a work slot, by the publish queue's thread
    or the receiving one) decodes and checks it and returns its block and `finish(stored)`,
    called once it is stored or has failed (the servicer's replay ticket)."""

    node_id: str
    session_id: str
    round: int
    prepare: Callable[[], tuple[SummaryBlock, Callable[[bool], None]]]


class Publishing(Part):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._publish_rate = PublishRateLimit(ctx.cfg.max_publishes_per_s)
        self._near_quota = QuotaWarnings("max_node_summaries", "publishes")
        self.queue = PublishQueue(self.run_batch)

    def submit(self, work: Received) -> tuple[int, int]:
        """A received publish, decoded, checked and stored; (accepted, duplicates). With
        `publish_queue`, by the publish queue's thread (publishqueue.py) in a batch, the
        caller asleep meanwhile; else here, by the caller's thread, in a work slot, its commit
        shared with the publishes of the other threads committing at the time."""
        if self.cfg.publish_queue:
            return self.queue.submit(work.node_id, work)
        out = self.run_batch([work])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def run_batch(self, works: Sequence[Received]) -> list[tuple[int, int] | Exception]:
        """A batch of received publishes (the publish queue's, or one alone): each prepared in
        a work slot, then all of them stored in one commit (`publish_many`). Every replay
        ticket taken is ended, with whether its publish was stored, whatever happens."""
        out: list[tuple[int, int] | Exception] = [InvalidArgument("not run")] * len(works)
        ready: list[tuple[int, Publish, Callable[[bool], None]]] = []
        complete = False
        try:
            for i, w in enumerate(works):
                try:
                    with self.work:
                        block, finish = w.prepare()
                except Exception as exc:  # noqa: BLE001 - each publish its own outcome
                    out[i] = exc
                    continue
                ready.append((i, Publish(w.node_id, w.session_id, w.round, block), finish))
            try:
                stored: list[tuple[int, int] | Exception] = self.publish_many([p for _, p, _ in ready])
            except Exception as exc:  # noqa: BLE001 - their tickets end all the same
                stored = [exc] * len(ready)
            for (i, _, _), res in zip(ready, stored):
                out[i] = res
            complete = True
        finally:
            for i, _, finish in ready:
                finish(complete and not isinstance(out[i], BaseException))
        return out

    @property
    def max_summaries(self) -> int:
        """The most summaries one publish may carry."""
        return self.manifest.prompts_per_round * MAX_SUMMARIES_FACTOR

    def check_count(self, count: int) -> None:
        """A publish's number of summaries against the per-round limit, before anything is
        decoded (the servicer asks in the receiving thread)."""
        limit = self.max_summaries
        if count > limit:
            raise ResourceExhausted(f"{count} summaries in one publish; at most {limit} per round")

    def _validate_summary(self, s: SummaryRow) -> None:
        where = f"summary for prompt {s.prompt_id[:40]!r}"
        if s.prompt_id not in self.known_prompts:
            raise InvalidArgument(f"{where}: unknown prompt id (not in the federation's dataset "
                                  f"{self.manifest.dataset_id})")
        if s.n != self.manifest.n:
            raise InvalidArgument(f"{where}: n={s.n} but the federation samples n={self.manifest.n}")
        if len(s.prompt_id) > MAX_ID_LEN:
            raise InvalidArgument(f"{where}: prompt id longer than {MAX_ID_LEN} characters")
        if not 0 <= s.k <= s.n:
            raise InvalidArgument(f"{where}: k={s.k} is not in [0, n={s.n}]")
        if len(s.lengths) != s.n or len(s.mean_logprobs) != s.n:
            raise InvalidArgument(f"{where}: {len(s.lengths)} lengths and {len(s.mean_logprobs)} mean log-probs "
                                  f"for n={s.n} responses")
        if any(length < 1 for length in s.lengths):
            raise InvalidArgument(f"{where}: every response has at least one token")
        values = [s.reward_mean, s.reward_std, *s.mean_logprobs]
        if not all(math.isfinite(v) for v in values):
            raise InvalidArgument(f"{where}: non-finite number")
        if any(v > 1e-6 for v in s.mean_logprobs):
            raise InvalidArgument(f"{where}: a mean log-prob is positive (log-probs are <= 0)")
        if any(v < MIN_MEAN_LOGPROB for v in s.mean_logprobs):
            raise InvalidArgument(f"{where}: a mean log-prob is below {MIN_MEAN_LOGPROB}, which sampling does not "
                                  "produce")
        if abs(s.reward_mean - s.k / s.n) > 1e-6:
            raise InvalidArgument(f"{where}: reward_mean {s.reward_mean} contradicts k/n = {s.k}/{s.n}")
        _, pop, pop_tol, sample, sample_tol = _reward_tables(s.n)
        if not (abs(s.reward_std - pop[s.k]) <= pop_tol[s.k] or abs(s.reward_std - sample[s.k]) <= sample_tol[s.k]):
            raise InvalidArgument(f"{where}: reward_std {s.reward_std} contradicts k/n = {s.k}/{s.n} (binary "
                                  "rewards: the sample or population std of k ones and n - k zeros)")
        if s.bundle_digest:
            # the broker attaches a digest when it holds the bundle (UploadBundle); a digest
            # claimed in a summary could name bytes that never arrive
            raise InvalidArgument(f"{where}: bundle_digest must be empty; the broker sets it when the bundle is "
                                  "uploaded")

    def publish(self, node_id: str, session_id: str, round: int, summaries: Sequence[SummaryRow]) -> tuple[int, int]:
        with self.work:
            block = self.check_rows(node_id, round, summaries)
        return self._publish(node_id, session_id, round, block)

    def check_rows(self, node_id: str, round: int, summaries: Sequence[SummaryRow]) -> SummaryBlock:
        """`publish`'s checks on summaries as rows; the block they make. The caller holds a
        work slot."""
        self._validate_rows(node_id, round, summaries)
        return SummaryBlock.from_rows(list(summaries)) if summaries else SummaryBlock.from_columns(
            node_id, round, [], *([[]] * 9))

    def check_block(self, node_id: str, round: int, block: SummaryBlock) -> None:
        """`publish`'s checks on summaries as columns, on arrays; a block that fails one is
        checked row by row, so that the error is the one `publish` raises. The caller holds
        a work slot."""
        if not self._block_valid(node_id, round, block):
            self._validate_rows(node_id, round, block.rows())
            raise InvalidArgument("the summaries are malformed")  # not reached: the row checks raise

    def _validate_rows(self, node_id: str, round: int, summaries: Sequence[SummaryRow]) -> None:
        self.check_count(len(summaries))
        seen = set()
        for s in summaries:
            if s.node_id != node_id or s.round != round:
                raise InvalidArgument("every summary must carry the publishing node and round")
            if s.prompt_id in seen:
                raise InvalidArgument(f"prompt {clip(s.prompt_id)} appears twice in one publish")
            seen.add(s.prompt_id)
            self._validate_summary(s)

    def _block_valid(self, node_id: str, round: int, b: SummaryBlock) -> bool:
        """Every check of `_validate_rows` on the block's columns at once."""
        count = len(b)
        if count > self.max_summaries:
            return False
        if b.node_id != node_id or b.round != round or b.digests is not None:
            return False
        if not count:
            return True
        if not self._ids_valid(b.prompt_ids):
            return False
        n = self.manifest.n
        # bounds as one minimum and one maximum per column (no array of comparisons): NaN
        # fails them, as it propagates through both, and so do infinities
        if not (_within(b.n, n, n) and _within(b.k, 0, n) and _within(b.n_lengths, n, n)
                and (b.n_logprobs is b.n_lengths or _within(b.n_logprobs, n, n))  # one array from a publish's columns
                and _within(b.lengths, 1, None) and _within(b.mean_logprobs, MIN_MEAN_LOGPROB, 1e-6)):
            return False
        mean_of, pop, pop_tol, sample, sample_tol = _reward_tables(n)
        k = b.k
        # first the exact values, which nodes send (summarise's k / n and sample std are the
        # tables' bits for n = 2-4, 8, 16, 32, 64); the tolerances only when one differs
        if not (b.reward_mean == mean_of[k]).all():
            with np.errstate(invalid="ignore"):
                if not (np.abs(b.reward_mean - mean_of[k]) <= 1e-6).all():  # NaN and infinities fail it
                    return False
        std = b.reward_std  # the population or the sample std of k ones and n - k zeros
        if ((std == sample[k]) | (std == pop[k])).all():
            return True
        with np.errstate(invalid="ignore"):
            ok = (np.abs(std - pop[k]) <= pop_tol[k]) | (np.abs(std - sample[k]) <= sample_tol[k])
        return bool(ok.all())

    def _ids_valid(self, pids: list[str]) -> bool:
        """No prompt id twice, every one in the federation's dataset (once per interned list)."""
        facts = facts_of(pids)
        got = None if facts is None else facts.get("valid")
        if got is not None and got[0] is self.known_prompts:
            return got[1]
        valid = len(set(pids)) == len(pids) and self.known_prompts.issuperset(pids)
        if facts is not None:
            facts["valid"] = (self.known_prompts, valid)
            if valid:
                facts["unique"] = True
        return valid

    def _publish(self, node_id: str, session_id: str, round: int, summaries: SummaryBlock) -> tuple[int, int]:
        out = self.publish_many([Publish(node_id, session_id, round, summaries)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def publish_many(self, items: Sequence[Publish]) -> list[tuple[int, int] | Exception]:
        """Checked publishes, each of another node, stored in one commit: for each, (accepted,
        duplicates) or the error it failed with (one that fails does not stop the others)."""
        if len({p.node_id for p in items}) != len(items):
            raise ValueError("publish_many: at most one publish per node")  # the queue defers the second
        out: list[tuple[int, int] | Exception | None] = [None] * len(items)
        live = []
        for i, p in enumerate(items):
            try:
                self._open(p)
                live.append(i)
            except Exception as exc:  # noqa: BLE001 - each publish its own outcome
                out[i] = exc
        # The write happens outside the broker's lock and outside a work slot (it waits for
        # the disk, not for the interpreter), so that concurrent publishes share one commit
        # (the state's group commit) and nobody else waits for them; one node's
        # publishes are serialised (its node lock: its published count). Acknowledged, and
        # visible to matching through the index, only once durable.
        locks = {id(lock): lock for lock in (self.registry.node_lock(items[i].node_id) for i in live)}
        with contextlib.ExitStack() as held:
            for key in sorted(locks):  # one order for every holder of several
                held.enter_context(locks[key])
            rows = []
            for i in live:
                p = items[i]
                try:
                    node = self.registry.check(p.node_id, p.session_id)
                    self._check_quota(p)  # again, exact: the node's stores wait for its lock
                except Exception as exc:  # noqa: BLE001
                    out[i] = exc
                    continue
                rows.append((i, replace(node, round=max(node.round, p.round), last_seen=self.clock(), state="online")))
            # the summaries and each node's count and round in one transaction
            stored = self.state.put_summary_blocks([(items[i].block, row) for i, row in rows]) if rows else []
            for (i, row), res in zip(rows, stored):
                out[i] = res
                if isinstance(res, BaseException):
                    continue
                p = items[i]
                try:
                    self.registry.remember(replace(row, published=row.published + res[0]))
                    self.index.add_columns(p.round, p.node_id, p.block.prompt_ids, p.block.k)
                except Exception:  # noqa: BLE001 - durable: its answer stands, and the others'
                    log.exception("a publish of node %s, round %d is stored, but the broker's memory of it was not "
                                  "updated; the round's index is read again from the state", clip(p.node_id), p.round)
                    self.index.forget(p.round)
        with self.cond:
            for res in out:
                if isinstance(res, tuple):
                    self.counters["summaries"] += res[0]
                    self.counters["duplicate_summaries"] += res[1]
        # Wake the round's long-polls only when this publish may have completed it: a thousand
        # waiters woken by each of a thousand publishes is a million wake-ups a round. A round
        # closed by its deadline wakes its waiters by their own timeout; one closed by a node
        # going offline or leaving, by wake_ready_rounds (housekeeping, every second).
        if self.cfg.mode == "sync":
            for round in sorted({items[i].round for i, res in enumerate(out) if isinstance(res, tuple)}):
                try:
                    if self.rounds.ready(round):
                        self.wakeups.wake(("round", round))
                except Exception:  # noqa: BLE001 - the publishes are stored; housekeeping wakes the round
                    log.exception("round %d: readiness after a publish could not be read; housekeeping retries it "
                                  "within a second", round)
        return out  # type: ignore[return-value]

    def _open(self, p: Publish) -> None:
        """A publish's session checked and marked alive, its rate limited, its node's quota
        checked (near the quota, outside the broker's lock: the check then reads the state),
        its round opened."""
        with self.cond:
            self.registry.touch(p.node_id, p.session_id)
            self._rate_limit(p.node_id)
            if self._within_quota(p):
                self._admitted(p)
                return
        self._check_quota(p)
        with self.cond:
            self._admitted(p)

    def _admitted(self, p: Publish) -> None:
        """A publish within its node's quota (the caller holds the lock): the operator is
        told when it takes the node near the quota (its summaries held and the publish's,
        an upper bound: some may be held already), and its round is opened."""
        quota = self.cfg.max_node_summaries
        self._near_quota.note(p.node_id, self.state.summaries_held(p.node_id) + len(p.block), quota)
        self._open_round(p.node_id, p.round)

    def _open_round(self, node_id: str, round: int) -> None:
        """The publish's round opened when it is new (the caller holds the broker's lock)."""
        rnd = self.rounds.get(round)
        if rnd is None:
            if not self.rounds.may_open(node_id, round):
                raise FailedPrecondition(
                    f"round {round} is implausibly far ahead of the federation: a node may open a round up to "
                    f"{MAX_ROUNDS_AHEAD} past the highest round two nodes have published "
                    f"({self.rounds.agreed()}) or past its own; at most {self.rounds.open_limit(node_id)} for "
                    f"{clip(node_id)}")
            self.rounds.put(RoundRow(round=round, state="open", opened_at=self.clock()))
            # nothing of a round is stored before its row: its index starts empty (rather
            # than read back, with the first group commit's blocks, by the first publish)
            self.index.open(round)
        self.rounds.note_published(node_id, round)

    def _within_quota(self, p: Publish) -> bool:
        """Whether the node's held summaries and all of the publish's stay within its quota
        (no state read: the state's count)."""
        quota = self.cfg.max_node_summaries
        return not quota or self.state.summaries_held(p.node_id) + len(p.block) <= quota

    def _check_quota(self, p: Publish) -> None:
        """The summaries the state holds of the node and the publish's new ones against
        `max_node_summaries`: a node publishing round after round, far ahead of the others
        (which retention keeps), must not grow the state without bound. The state's count
        is read without a lock; only near the quota are the publish's summaries already held
        (a publish sent again after a lost answer) looked up, and not counted. Called before
        the round is opened, and again under the node's lock just before the store (two
        publishes of a node in flight cannot pass it together)."""
        if self._within_quota(p):
            return
        quota, node_id, held = self.cfg.max_node_summaries, p.node_id, self.state.summaries_held(p.node_id)
        have = {h.prompt_id for h in self.state.summary_heads(round=p.round, node_id=node_id,
                                                              prompt_ids=p.block.prompt_ids)}
        count = len(set(p.block.prompt_ids) - have)
        if count and held + count > quota:
            raise ResourceExhausted(
                f"node {clip(node_id)} holds {held:,} summaries at the broker; {count:,} more would pass its quota of "
                f"{quota:,} (broker.max_node_summaries). Retention (broker.keep_rounds) frees them as rounds go by; the "
                "operator can raise the quota")

    def _rate_limit(self, node_id: str) -> None:
        self._publish_rate.check(node_id)

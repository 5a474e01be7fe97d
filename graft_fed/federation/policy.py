"""The node's side of issue 12 as pure policy: what to do with a broker's answer when the
broker (or a peer behind it) may be hostile. graft_fed/node/peers.py calls them
(fetch_offers, BrokerPeers._serve_uploads); nothing here does I/O.

- `fetch_failure_is_per_offer`: a fetch the broker refuses (NOT_FOUND: a bundle pruned or
  never uploaded; PERMISSION_DENIED: no grant; INVALID_ARGUMENT; FAILED_PRECONDITION)
  concerns that one offer: skip it and go on with the step. Only a failure of the broker
  itself (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...) means the exchange is lost.
- `undelivered_entries`: offers whose bundle never arrived are reported as a group the
  receiver could not use (mean s 0, admitted 0, not rejected, marked undelivered), so a
  source that claims groups (an inflated k wins ties) and never delivers them becomes the
  least compatible source for that receiver instead of the most (a pair with no reports
  counts as best); marked, they do not count in its quarantine rate, which a lying source
  could otherwise dilute by withholding as many groups as it lies about.
- `refused_record_entry`: a bundle that arrived, with the right digest (and signature), but
  whose record is malformed or poisoned is the source's own doing: reported as rejected.
- `offers_to_fetch`: the node fetches only offers for its own all-fail prompts of the round,
  one per prompt, whatever else the broker offers (groups for prompts it solved or never
  had, several for one prompt, thousands of them), so a hostile broker cannot make it
  download, decode and report what it would never train on.
- `uploads_to_serve`: under `matched_only` privacy the node uploads only what it can see
  was matched in the current window: groups of its own rounds within the window, that it
  published as informative (0 < k < n, the only groups ever matched as a source). An upload
  request for an old round, an all-fail or all-pass group, or a group it never had is
  refused, however the broker words it.
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping, Sequence

from graft_fed.federation.errors import FailedPrecondition, FederationError, InvalidArgument, NotFound, PermissionDenied
from graft_fed.federation.limits import MAX_ID_LEN, printable
from graft_fed.federation.messages import Offer, ReportEntry

#: Refusals of one fetch that say nothing about the broker being reachable.
PER_OFFER_FETCH_ERRORS = (NotFound, PermissionDenied, InvalidArgument, FailedPrecondition)


def fetch_failure_is_per_offer(exc: FederationError) -> bool:
    """True when a FetchBundle failure concerns only that offer (skip it, count it, report
    it with `undelivered_entries`); False when the broker is lost (the caller re-raises)."""
    return isinstance(exc, PER_OFFER_FETCH_ERRORS)


def undelivered_entries(offers: Iterable[Offer], received: Collection[str],
                        already_reported: Collection[tuple[str, str]] = ()) -> list[ReportEntry]:
    """One report entry per offer whose bundle did not arrive (no digest by the fetch
    deadline, or the fetch was refused): `received` holds the prompt ids of the records
    that arrived; `already_reported` the (source, prompt id) pairs the receiver reports
    otherwise (e.g. a bad signature, reported as rejected)."""
    out, seen = [], set(already_reported)
    for o in offers:
        key = (o.source_node, o.prompt_id)
        if o.prompt_id in received or key in seen:
            continue
        seen.add(key)
        out.append(ReportEntry(source=o.source_node, prompt_id=o.prompt_id, mean_s=0.0, admitted_fraction=0.0,
                               rejected=False, undelivered=True))
    return out


def offers_to_fetch(offers: Iterable[Offer], wanted: Collection[str]) -> tuple[list[Offer], int]:
    """(offers to fetch, how many were ignored): the first offer for each prompt id in
    `wanted` (the receiver's all-fail prompts of the round) whose source is a node id the
    broker accepts (1-256 printable characters: it goes into the node's log, metrics and
    reports); every other offer is ignored: not fetched, not reported."""
    out, seen, ignored = [], set(), 0
    for o in offers:
        good_source = 0 < len(o.source_node) <= MAX_ID_LEN and printable(o.source_node) == o.source_node
        if o.prompt_id in wanted and o.prompt_id not in seen and good_source:
            seen.add(o.prompt_id)
            out.append(o)
        else:
            ignored += 1
    return out, ignored


def refused_record_entry(offer: Offer) -> ReportEntry:
    """The report of a delivered group the receiver refused for its content (a malformed or
    poisoned record, claimed advantages or log-probs that screening refused)."""
    return ReportEntry(source=offer.source_node, prompt_id=offer.prompt_id, mean_s=0.0, admitted_fraction=0.0,
                       rejected=True)


def uploads_to_serve(requests: Sequence[tuple[str, int]], current_round: int, window_rounds: int,
                     informative: Mapping[int, Collection[str]]) -> tuple[list[tuple[str, int]],
                                                                         list[tuple[str, int]]]:
    """(to upload, refused) of a broker's upload requests under `matched_only`.

    `current_round`: the node's round (its trainer step); `window_rounds`: how many rounds
    back a group can still be matched (0 in synchronous mode, the broker manifest's
    `staleness_rounds` in asynchronous mode); `informative[r]`: prompt ids of the node's
    own groups of round r with 0 < k < n. A request outside the window, for a round the node
    has not reached, or for a group it does not hold as informative is refused."""
    ok, refused = [], []
    for prompt_id, rnd in requests:
        in_window = current_round - max(0, window_rounds) <= rnd <= current_round
        if in_window and prompt_id in informative.get(rnd, ()):
            ok.append((prompt_id, rnd))
        else:
            refused.append((prompt_id, rnd))
    return ok, refused

"""Sessions: joining (checked against the federation's manifest), leaving, heartbeats and
the session check every request makes (the node rows themselves live in broker/registry.py)."""

from __future__ import annotations

import hmac
import logging
import secrets
import time
import unicodedata
from dataclasses import replace
from typing import Mapping

from graft_fed.broker.context import Part
from graft_fed.broker.state import BrokerState, NodeRow
from graft_fed.federation.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from graft_fed.federation.limits import MAX_ID_LEN, MAX_STRING_LEN, MAX_TOKENIZER_ID_LEN, clip
from graft_fed.federation.manifest import Manifest, differences
from graft_fed.federation.messages import Privacy
from graft_fed.federation.nodesecret import parse_secret_hash, secret_hash

log = logging.getLogger("graft_fed.broker")

PRIVACY = Privacy.names()


def check_id(value: str, what: str, limit: int = MAX_ID_LEN, empty: bool = False) -> None:
    """Printable: no control, format or other category-C characters (ids end up in logs and
    in `graft-fed status` on an operator's terminal, where C1 controls are escape sequences),
    and no line or paragraph separator (U+2028, U+2029: tools that split lines on them
    would read a forged log line)."""
    if (not value and not empty) or len(value) > limit or any(
            unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp") for c in value):
        raise InvalidArgument(f"{what} must be {0 if empty else 1}-{limit} printable characters, got {clip(value)}")


FORGET_OPTIONS = ("hold_for",)


def hold_for_of(options: Mapping[str, str] | None) -> str:
    """The `hold_for` of an operator's forget_secret request (broker/spool.py); ValueError
    for an option it does not take."""
    unknown = sorted(set(options or ()) - set(FORGET_OPTIONS))
    if unknown:
        raise ValueError(f"forget_secret takes the option {', '.join(FORGET_OPTIONS)}, not "
                         f"{', '.join(map(repr, unknown))}")
    return (options or {}).get("hold_for", "")


def forget_secret(state: BrokerState, node_id: str, hold_for: str = "", now: float | None = None,
                  mtls: bool = False) -> tuple[str, NodeRow | None]:
    """Give `node_id` back (see Sessions.join): the hash of the node secret that holds it is
    dropped, so that the next Join under it carrying a node secret holds it; or, with
    `hold_for` (the hash of a node's secret, `parse_secret_hash`), replaced by it, so that
    only that node can join under the id (one that has not joined yet included). When that
    changes what holds the id, a session under it is ended (the node marked left, at
    `now`): a taker that is online is refused at its next call and must Join again, which,
    held for another node, it cannot; applied again, it changes nothing and ends nothing.
    `mtls`: the broker checks certificates, which hold the ids instead (the answer says so).
    (What was done, in words; the node's row as written, None when none was.)"""
    hold_for = parse_secret_hash(hold_for) if hold_for else ""
    held = state.node_secret(node_id)
    node = state.get_node(node_id)
    ended = None
    if hold_for != held:
        state.set_node_secret(node_id, hold_for)
        if node is not None and node.state not in ("left", "registered"):
            ended = replace(node, state="left", last_seen=time.time() if now is None else now)
            state.upsert_node(ended)
    if hold_for == held:
        said = (f"node id {node_id!r} is already held for the node whose secret hashes to {hold_for[:12]}...; "
                "nothing changed" if hold_for else f"node id {node_id!r} was not held by any node secret; nothing "
                "changed")
    elif hold_for:
        said = (f"node id {node_id!r} is held for the node whose secret hashes to {hold_for[:12]}...: only a Join "
                "carrying that secret is taken under it")
    else:
        said = f"node id {node_id!r} is no longer held: the next Join under it that carries a node secret holds it"
    if ended is not None:
        said += "; its session is ended: whoever holds it is refused at its next call and must Join again"
    if node is None:
        said += "; no node has joined under this id (check it, if you meant one that has)"
    if mtls and hold_for:  # Join takes the secret a certificate for the id brings
        rest = said[said.index(";"):] if ";" in said else ""
        said = (f"node id {node_id!r}: the hash {hold_for[:12]}... is kept, but this broker checks certificates: a "
                "Join with a certificate for the id replaces it, so the certificate, not the hash, holds the id"
                + rest)
    return said, ended


class Sessions(Part):
    def forget_secret(self, node_id: str, hold_for: str = "") -> str:
        """`forget_secret` on a running broker (an operator's request, broker/spool.py), in
        turn with joins; a session it ends is ended as a Leave ends one."""
        with self.cond, self.registry.node_lock(node_id):
            said, ended = forget_secret(self.state, node_id, hold_for, self.clock(), self.cfg.client_ca is not None)
            if ended is not None:
                self.registry.remember(ended)
        if ended is not None:
            self._gone(node_id)
        return said

    def node_state(self, node: NodeRow) -> str:
        if node.state in ("left", "registered"):
            return node.state
        return "online" if self.registry.is_online(node) else "offline"

    def join(self, node_id: str, model_id: str, tokenizer_id: str, manifest: Manifest, privacy: str,
             resume_round: int, node_secret: str = "") -> tuple[str, int]:
        """A new session for `node_id`. The first Join that carries a node secret holds the id:
        a later Join under it must carry the same one, or is refused PERMISSION_DENIED, nothing
        of the node's changed. Without it, anyone who could reach the broker took any node id
        over by joining under it (the honest node's session ended; what it published next
        was the taker's). Under mutual TLS the certificate proves the caller and the held
        secret is replaced by the one it brings (a node moved to a new machine)."""
        check_id(node_id, "node_id")
        if len(node_secret) > MAX_STRING_LEN:
            raise InvalidArgument(f"node_secret must be at most {MAX_STRING_LEN} characters")
        check_id(model_id, "model_id")
        check_id(tokenizer_id, "tokenizer_id", MAX_TOKENIZER_ID_LEN, empty=True)
        if privacy not in PRIVACY:
            raise InvalidArgument(f"privacy must be one of {PRIVACY}, got {privacy!r}")
        diff = differences(self.manifest, manifest)
        if diff:
            self.counters["rejected_join"] += 1
            raise FailedPrecondition("the node's settings differ from the federation manifest: " + "; ".join(diff)
                                     + ". Use the broker's dataset, seed (the node's run.schedule_seed, or run.seed "
                                     "when that is unset), n, prompts per round, verifier and advantage "
                                     "(the node's algorithm.scale_rewards/algorithm.std).")
        session = secrets.token_hex(16)
        brought = secret_hash(node_secret)
        with self.cond, self.registry.node_lock(node_id):
            held = self.state.node_secret(node_id)
            if held and not hmac.compare_digest(held, brought) and self.cfg.client_ca is None:
                self.counters["rejected_join"] += 1
                raise PermissionDenied(
                    f"node id {clip(node_id)} is held by another node: this Join does not carry its node secret. A "
                    "new run needs a federation.node_id of its own; the same node on another machine or in another "
                    "folder takes its run folder's node_secret file with it, or asks the broker's operator to hold "
                    "the id for its new secret (`graft-fed broker forget-secret --hold-for <the hash that "
                    "`graft-fed node --print-secret-hash` prints>`)")
            if brought and brought != held:
                self.state.set_node_secret(node_id, brought)
            prev = self.registry.get(node_id)
            row = NodeRow(node_id=node_id, model_id=model_id, tokenizer_id=tokenizer_id, privacy=privacy,
                          state="online", session_id=session, round=self.rounds.plausible(node_id, resume_round),
                          last_seen=self.clock(), published=prev.published if prev else 0)
            self.state.upsert_node(row)
            self.registry.remember(row)
            self.counters["joins"] += 1
        self.rounds.forget_readiness()  # a round near the node's may wait for it now
        log.info("node %s joined (model %s, privacy %s, round %d)", node_id, model_id, privacy, resume_round)
        return session, self.rounds.current()

    def leave(self, node_id: str, session_id: str) -> None:
        with self.cond, self.registry.node_lock(node_id):
            node = self.registry.check(node_id, session_id)
            row = replace(node, state="left", last_seen=self.clock())
            self.state.upsert_node(row)
            self.registry.remember(row)
        self._gone(node_id)
        log.info("node %s left", node_id)

    def _gone(self, node_id: str) -> None:
        """After a node's session ended (the caller holds no lock)."""
        self.rounds.forget_readiness()  # a remembered "not yet" may have waited for this node
        self.rounds.wake_ready()  # the rounds that waited for it may be ready now

    def heartbeat(self, node_id: str, session_id: str, round: int) -> tuple[int, int]:
        """Never waits for the broker's lock: a session check and a liveness mark in memory
        (a higher round is written through), then two cached numbers."""
        self.registry.touch(node_id, session_id, self.rounds.plausible(node_id, round))
        return self.rounds.current(), self.registry.online_count()

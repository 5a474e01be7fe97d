"""The GRAFT step, written once for every kind of peer (docs/algorithm.md steps 1-13).

    own rollouts and rewards -> record -> publish what this model offers (Peers.publish)
    -> obtain offers for its all-fail prompts (Peers.offers)
    -> receive: re-verify, re-tokenise, score, gate (graft/receive.py)
    -> report compatibility (Peers.report) -> optimise with peer-last minibatches

The step has two halves because co-trained models must all publish before any of them can
be offered anything: `begin` runs the first line, `finish` the rest; a lone learner (stored
peers, a federation node) runs `step`, which is both. The trainer knows nothing of peers:
it samples, records and optimises; this module puts peer groups between the two.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from graft_fed.core.records import GroupRecord
from graft_fed.graft.receive import GroupReport, Receiver, receive
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.grpo import GRPOTrainer


@dataclass
class Offers:
    """What the peers offer a learner for one step: for some of its all-fail prompts, one
    source group each, and diagnostics of the offer (merged into the step's metrics)."""

    records: dict[str, GroupRecord] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


class Peers(Protocol):
    """Where a learner's peer groups come from. Three kinds: a stored run's trajectories
    (graft/stored.py), models co-trained in the same process (graft/cotrain.py), and a
    federation's broker over gRPC (node/peers.py)."""

    def publish(self, learner: GRPOTrainer, data: StepData) -> dict[str, Any]:
        """Make this step's own groups available to the peers; returns metrics."""

    def offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        """The peer groups for this step's all-fail prompts (one source group per prompt)."""

    def report(self, learner: GRPOTrainer, reports: Sequence[GroupReport]) -> dict[str, Any]:
        """Tell the peers how compatible each received group was; returns metrics."""


#: graft.max_peer_tokens 0: a peer response may have this many times the receiver's own cap
PEER_TOKENS_FACTOR = 4


def model_context(model: Any) -> int | None:
    """The most positions (prompt + response tokens) `model` takes; None when its config does
    not say."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def receiver_of(learner: GRPOTrainer) -> Receiver:
    """What receiving needs from a learner: its tokenizer, EOS, verifier and old policy, and
    the longest peer response it takes (graft.max_peer_tokens, within its model's context)."""
    a = learner.cfg.algorithm
    cap = learner.cfg.graft.max_peer_tokens or PEER_TOKENS_FACTOR * learner.sampling.max_new_tokens
    return Receiver(tokenizer=learner.tokenizer, eos_id=learner.engine.eos_ids[0], verifier=learner.verifier,
                    score=learner.score_responses, graft=learner.cfg.graft, scale_rewards=a.scale_rewards, std=a.std,
                    max_response_tokens=cap, context_tokens=model_context(learner.model))


@dataclass
class Begun:
    """A step between its two halves: the own groups, collected and published."""

    data: StepData
    metrics: dict[str, Any]
    elapsed_s: float  # time the first half took (the step's time counts only its learner's own work)


def begin(learner: GRPOTrainer, peers: Peers) -> Begun:
    """Sample and verify this step's own groups, record them, publish them to the peers."""
    t0 = time.perf_counter()
    data = learner.collect()
    learner.record(data.groups)
    metrics = peers.publish(learner, data)
    return Begun(data=data, metrics=metrics, elapsed_s=time.perf_counter() - t0)


def finish(learner: GRPOTrainer, peers: Peers, begun: Begun) -> dict[str, Any]:
    """Receive the peers' offers, optimise (own groups first, peers last), then report on
    every received group: after the update, so that a group whose minibatch gave a
    non-finite loss or gradient (the update was skipped) is reported as rejected."""
    t0 = time.perf_counter() - begun.elapsed_s
    groups = begun.data.groups
    offered = peers.offers(learner, groups)
    result = receive(receiver_of(learner), groups, offered.records)
    metrics = {**begun.metrics, **offered.metrics, **result.metrics}
    row = learner.finish_step(begun.data, result.groups, metrics, t0)
    bad = set(learner.nonfinite_groups)
    reports = [GroupReport(r.prompt_id, r.source, math.nan, 0.0, True) if (r.source, r.prompt_id) in bad else r
               for r in result.reports]
    row.update(peers.report(learner, reports))
    return row


def step(learner: GRPOTrainer, peers: Peers) -> dict[str, Any]:
    """One whole GRAFT step of a learner whose peers do not wait for each other."""
    return finish(learner, peers, begin(learner, peers))

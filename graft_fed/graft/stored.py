"""Peers = a stored run's trajectories (docs/algorithm.md, "Stored peers").

The receiver trains against a peer run's logged groups (text, generation log-probs,
rewards) on the same prompt schedule: for each of its all-fail prompts, the peer run's
group for it, every candidate in this one direction, no balancing. Publishing and reporting
are no-ops: a stored run cannot learn anything back.
"""

from __future__ import annotations

from typing import Any, Sequence

from graft_fed.core.advantages import advantage_id
from graft_fed.core.exchange import SourceGroup, select_for_receiver
from graft_fed.errors import ConfigError, DataError
from graft_fed.graft.receive import GroupReport, offer_metrics, own_complementarity
from graft_fed.graft.step import Offers
from graft_fed.store import TrajectoryStore
from graft_fed.trainer.config import GraftSection
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.grpo import GRPOTrainer


class StoredPeers:
    def __init__(self, graft: GraftSection, advantage: str | None = None) -> None:
        """`advantage`: how the receiver normalises its own advantages
        (core.advantages.advantage_id); a stored run that recorded another is refused, since
        its groups' advantages are trained on as they are. None = not checked."""
        if graft.peer_store is None:
            raise ConfigError("stored peers need graft.peer_store (a trajectories.sqlite of a finished run)")
        self.run_id, self.match = graft.peer_run, graft.store_match
        self.store = TrajectoryStore(graft.peer_store, readonly=True)
        runs = self.store.runs()
        if not runs:
            self.store.close()
            raise DataError(f"peer store {graft.peer_store} holds no groups")
        names = [r[0] for r in runs]
        if self.run_id is None and len(runs) > 1:
            self.store.close()
            raise ConfigError(f"peer store {graft.peer_store} holds several runs ({', '.join(names)}); "
                              "choose one with graft.peer_run")
        if self.run_id is not None and self.run_id not in names:
            self.store.close()
            raise ConfigError(f"graft.peer_run {self.run_id!r} is not in {graft.peer_store}; it holds: "
                              f"{', '.join(names)}")
        run_ids = [self.run_id] if self.run_id is not None else names
        recorded = {self.store.run_advantage(r) for r in run_ids} - {None}
        if advantage is not None and recorded and recorded != {advantage}:
            self.store.close()
            raise ConfigError(f"peer store {graft.peer_store} was recorded with advantages normalised as "
                              f"{', '.join(sorted(recorded))} (scale_rewards/std), this run normalises them as "
                              f"{advantage}: its groups' advantages would be trained on as they are. Set "
                              "algorithm.scale_rewards and algorithm.std as the stored run had them")

    def close(self) -> None:
        self.store.close()

    def publish(self, learner: GRPOTrainer, data: StepData) -> dict[str, Any]:
        return {}

    def offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        mine = {g.prompt.id: (g.k, g.n) for g in groups}
        all_fail = [pid for pid, (k, _) in mine.items() if k == 0]
        found = self.store.lookup(all_fail, step=learner.step, run_id=self.run_id, match=self.match)
        chosen = select_for_receiver(mine, {pid: [(SourceGroup(source=rec.model_id, k=rec.k, round=rec.step), rec.n)]
                                            for pid, rec in found.items()}, {})
        cands, solved = own_complementarity(groups, [{pid: (rec.k, rec.n) for pid, rec in found.items()}])
        return Offers(records={pid: found[pid] for pid in chosen},
                      metrics=offer_metrics(groups, cands, solved, len(chosen)))

    def report(self, learner: GRPOTrainer, reports: Sequence[GroupReport]) -> dict[str, Any]:
        return {}


def train(trainer: GRPOTrainer, evaluate_before_after: bool = True) -> dict[str, Any]:
    """A single run to its end: plain GRPO, or GRAFT against the stored run its config names
    (graft.peer_store). What `train`, the Python API and experiments run."""
    if trainer.cfg.graft.peer_store is None:
        return trainer.train(evaluate_before_after)
    from graft_fed.graft import step as graft_step

    algo = trainer.cfg.algorithm
    peers = StoredPeers(trainer.cfg.graft, advantage_id(algo.scale_rewards, algo.std))
    try:
        return trainer.train(evaluate_before_after, step_fn=lambda: graft_step.step(trainer, peers))
    finally:
        peers.close()

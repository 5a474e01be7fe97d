"""Peers = the learner's own past (a replay-buffer baseline, not GRAFT; issue 15).

For each prompt this model failed entirely this step, its own most recent *informative*
group (0 < k < n) for the same prompt from an earlier step of this run, read from the run's
own trajectory store (`run.record_groups`, so a resumed run replays the same history). The
group then goes through the GRAFT step unchanged (graft/step.py, graft/receive.py): it is
re-verified, scored by the current behaviour policy (s = exp(lbar_now - lbar_then), the
gate admits it as it would a peer's) and trained on last with the advantages it had when it
was sampled. So the only thing that differs from GRAFT is where the replacement comes from:
the model itself, some steps ago, instead of another model now.

How it differs from TRL's experimental GRPO-with-replay-buffer: TRL keeps a buffer of the
run's groups with the largest reward spread, for any prompt, and fills a batch's
zero-variance groups with groups sampled from that buffer (other prompts). Here the
replacement is for the same prompt only (the receiver's replacement is keyed by prompt, as
every GRAFT transfer is), the most recent informative one, and it replaces all-fail groups
only (not all-pass ones). It can therefore only fire when the schedule revisits a prompt
(a second epoch over the training prompts), and only where the model once had a success.
"""

from __future__ import annotations

from typing import Any, Sequence

from graft_fed.errors import ConfigError
from graft_fed.graft.receive import GroupReport, offer_metrics
from graft_fed.graft.step import Offers
from graft_fed.store import TrajectoryStore
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.grpo import GRPOTrainer


def replay_offers(store: TrajectoryStore, run_id: str, step: int, groups: Sequence[Group]) -> Offers:
    """For each all-fail group of `groups` (sampled at `step`), the run's own latest
    informative group for that prompt recorded at an earlier step."""
    all_fail = [g.prompt.id for g in groups if g.k == 0]
    records = {}
    if step > 0 and all_fail:
        # Groups of this step are recorded before offers are asked for; only earlier ones count.
        found = store.lookup(all_fail, step=step - 1, run_id=run_id, match="latest_before")
        records = {pid: rec for pid, rec in found.items() if 0 < rec.k < rec.n}
    metrics = offer_metrics(groups, len(records), len(records), len(records), prefix="graft")
    return Offers(records=records, metrics=metrics)


class ReplayPeers:
    """The `Peers` protocol served from the learner's own trajectory store."""

    def publish(self, learner: GRPOTrainer, data: StepData) -> dict[str, Any]:
        return {}

    def offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        if learner.store is None:
            raise ConfigError("the replay baseline reads the run's own trajectory store: set run.record_groups: true")
        return replay_offers(learner.store, learner.run_id, learner.step, groups)

    def report(self, learner: GRPOTrainer, reports: Sequence[GroupReport]) -> dict[str, Any]:
        return {}

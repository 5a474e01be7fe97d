"""Co-training on one machine: N models, the same prompt batch each step, GRAFT exchange
in every direction (docs/algorithm.md steps 1-13; "N models" for the source choice).

Each model keeps exactly its GRPO rollout budget (n responses per prompt); the extra cost
of GRAFT is the receiver's likelihood pass over the peer responses it is offered, logged
as `time/graft`. Every member samples with a seed of its own (`member_seed`), as the
paper's independently trained models do; they share the prompt schedule's seed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from graft_fed.configbase import load_config, require
from graft_fed.core.exchange import CompatEstimate, select_sources
from graft_fed.core.records import GroupRecord
from graft_fed.errors import ConfigError
from graft_fed.graft import step as graft_step
from graft_fed.graft.receive import GroupReport, offer_metrics, own_complementarity
from graft_fed.graft.step import Offers
from graft_fed.trainer.config import ModelSection, OptimSection, TrainConfig, member_seed
from graft_fed.trainer.distributed import make_trainer
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.grpo import GRPOTrainer

log = logging.getLogger("graft_fed.cotrain")


@dataclass(frozen=True)
class MemberSection:
    """One co-trained model."""

    #: Short name: the member's run name, model id in exchange metrics, and output sub-folder.
    name: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    #: Optimiser of this member (null = the top-level `optim`).
    optim: OptimSection | None = None
    #: This member's own seed (initialisation, sampling); null = derived from run.seed and
    #: the name. The prompt schedule is the run's for every member (run.schedule_seed).
    seed: int | None = None
    #: Whether this member's groups are offered to the others. false: it only receives, as a
    #: federation node with privacy summaries_only does (e.g. to measure what one peer's
    #: groups do to the rest).
    shares: bool = True

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name, "every member needs a name without '/'")


@dataclass(frozen=True)
class CotrainConfig(TrainConfig):
    """A co-training run: the sections of a single run, shared by every member, plus members."""

    #: The models trained together (>= 2). Each trains in OUTPUT_DIR/<name>.
    members: tuple[MemberSection, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.members) >= 2, f"cotrain needs >= 2 members, got {len(self.members)}")
        names = [m.name for m in self.members]
        require(len(set(names)) == len(names), f"member names must be unique, got {names}")

    def member_config(self, i: int) -> TrainConfig:
        m = self.members[i]
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}
        base["run"] = dataclasses.replace(
            self.run, name=m.name, output_dir=str(Path(self.run.output_dir) / m.name),
            seed=m.seed if m.seed is not None else member_seed(self.run.seed, m.name),
            schedule_seed=self.run.prompt_schedule_seed)
        base["model"] = m.model
        base["optim"] = m.optim or self.optim
        return TrainConfig(**base)


def load_cotrain_config(path: str | Path, overrides: dict[str, Any] | None = None) -> CotrainConfig:
    return load_config(CotrainConfig, path, overrides, "cotrain config")


class CoTrainingPeers:
    """Peers = the other models co-trained in this process. One exchange per step for all
    members: once every member has published, `core.exchange.select_sources` chooses each
    receiver's source groups at once (for two models, exactly the paper's balanced rule);
    reports fold into one CompatEstimate per (source, receiver) pair."""

    def __init__(self, learners: Sequence[GRPOTrainer], balance: bool, source_choice: str = "compatibility",
                 shares: Sequence[bool] | None = None) -> None:
        self.learners = list(learners)
        self.balance = balance
        self.source_choice = source_choice
        self.shares = list(shares) if shares is not None else [True] * len(self.learners)
        self.compat: dict[tuple[int, int], CompatEstimate] = {}
        self._groups: dict[int, tuple[int, list[Group]]] = {}  # member -> (step, its own groups)
        self._chosen: list[dict[str, int]] | None = None

    def _index(self, learner: GRPOTrainer) -> int:
        for i, t in enumerate(self.learners):
            if t is learner:
                return i
        raise ValueError(f"{learner.model_id} is not a member of this co-training run")

    def publish(self, learner: GRPOTrainer, data: StepData) -> dict[str, Any]:
        self._groups[self._index(learner)] = (learner.step, list(data.groups))
        self._chosen = None
        return {}

    def _select(self) -> list[dict[str, int]]:
        if len(self._groups) != len(self.learners):
            raise RuntimeError("a member asked for offers before every member published its groups")
        kn = [{g.prompt.id: (g.k, g.n) for g in self._groups[i][1]} for i in range(len(self.learners))]
        if len({tuple(sorted(k)) for k in kn}) != 1:
            raise RuntimeError("members sampled different prompt batches; their data or schedule seed differ")
        compat = {pair: est.mean_s for pair, est in self.compat.items() if est.known}
        lead = self.learners[0]
        return select_sources(kn, self.balance, compat, can_source=self.shares, choice=self.source_choice,
                              key=f"{lead.cfg.run.prompt_schedule_seed}|{self._groups[0][0]}")

    def offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        r = self._index(learner)
        if self._chosen is None:
            self._chosen = self._select()
        chosen = self._chosen[r]
        records: dict[str, GroupRecord] = {}
        for pid, s in chosen.items():
            step, theirs = self._groups[s]
            src = self.learners[s]
            group = next(g for g in theirs if g.prompt.id == pid)
            records[pid] = group.to_record(step, src.model_id, src.tok_id, src.run_id)
        metrics: dict[str, Any] = {}
        others = []
        for s, other in enumerate(self.learners):
            if s == r:
                continue
            theirs = {g.prompt.id: (g.k, g.n) for g in self._groups[s][1]}
            others.append(theirs)
            c, v = own_complementarity(groups, [theirs])
            n_sel = sum(1 for x in chosen.values() if x == s)
            metrics.update(offer_metrics(groups, c, v, n_sel, prefix=f"graft/from/{other.model_id}"))
        cands, solved = own_complementarity(groups, others)
        metrics.update(offer_metrics(groups, cands, solved, len(records)))
        return Offers(records=records, metrics=metrics)

    def report(self, learner: GRPOTrainer, reports: Sequence[GroupReport]) -> dict[str, Any]:
        r = self._index(learner)
        by_name = {t.model_id: i for i, t in enumerate(self.learners)}
        for rep in reports:
            s = by_name[rep.source]
            self.compat[(s, r)] = self.compat.get((s, r), CompatEstimate()).add(
                rep.mean_s, rep.admitted_fraction, rep.rejected)
        return {}


class CoTrainer:
    def __init__(self, cfg: CotrainConfig, resume: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        if resume not in (None, "auto"):
            raise ConfigError("cotrain resumes every member from its own latest checkpoint: use --resume "
                              "without a path")
        # Under torchrun every member is sharded over all the processes (distributed.py);
        # the exchange below then runs identically on every process.
        self.trainers = [make_trainer(cfg.member_config(i), resume=resume, quiet=True)
                         for i in range(len(cfg.members))]
        steps = {t.step for t in self.trainers}
        if len(steps) != 1:
            raise ConfigError(f"members resumed at different steps {sorted(steps)}: their checkpoints "
                              "disagree; delete the newer ones so all members resume from the same step")
        self.peers = CoTrainingPeers(self.trainers, balance=cfg.graft.balance == "pairwise",
                                     source_choice=cfg.graft.source_choice,
                                     shares=[m.shares for m in cfg.members])

    @property
    def step(self) -> int:
        return self.trainers[0].step

    def close(self) -> None:
        for t in self.trainers:
            t.close()

    def __enter__(self) -> "CoTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train_step(self) -> list[dict[str, Any]]:
        # Every member publishes before any receives; each member's step time counts its own
        # work only (its collect, then its receive and update), so it compares with a lone run.
        begun = [graft_step.begin(t, self.peers) for t in self.trainers]
        return [graft_step.finish(t, self.peers, b) for t, b in zip(self.trainers, begun)]

    def train(self, evaluate_before_after: bool = True) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        summaries = [t.begin_train(evaluate_before_after) for t in self.trainers]
        rows: list[dict[str, Any]] = [{} for _ in self.trainers]
        bar = tqdm(total=self.cfg.run.steps, initial=self.step, desc="cotrain",
                   disable=self.quiet or not self.trainers[0].is_main,
                   dynamic_ncols=True)
        while self.step < self.cfg.run.steps:
            rows = self.train_step()
            for t, row in zip(self.trainers, rows):
                t.end_step(row)
            bar.update(1)
            bar.set_postfix({t.model_id: f"r={row['reward']:.2f} rep={row.get('graft/replaced', 0):.0f}"
                             for t, row in zip(self.trainers, rows)})
        bar.close()
        return [t.end_train(s, row, evaluate_before_after) for t, s, row in zip(self.trainers, summaries, rows)]

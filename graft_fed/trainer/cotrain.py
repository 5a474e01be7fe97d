"""Co-training on one machine: N models, the same prompt batch each step, GRAFT exchange
in every direction (GRAFT.md section 1; section 3's source choice for N > 2).

Each model keeps exactly its GRPO rollout budget (n responses per prompt); the extra cost
of GRAFT is the receiver's likelihood pass over the peer responses it is offered, logged
as `time/graft`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graft_fed.configbase import load_config, require
from graft_fed.core.exchange import select_sources
from graft_fed.errors import ConfigError
from graft_fed.trainer.config import ModelSection, OptimSection, TrainConfig
from graft_fed.trainer.graft import complementarity, offer_metrics, receive, to_record
from graft_fed.trainer.distributed import make_trainer
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

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name, "every member needs a name without '/'")


@dataclass(frozen=True)
class CotrainConfig(TrainConfig):
    """A co-training run: the sections of a single run, shared by every member, plus members."""

    #: The models trained together (>= 2). Each trains in OUTPUT_DIR/<name>.
    members: tuple[MemberSection, ...] = ()
    #: Smoothing of the running compatibility per (source, receiver) pair that picks the
    #: source when several could serve a prompt (N > 2).
    compat_ema: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.members) >= 2, f"cotrain needs >= 2 members, got {len(self.members)}")
        names = [m.name for m in self.members]
        require(len(set(names)) == len(names), f"member names must be unique, got {names}")
        require(0 <= self.compat_ema < 1, "compat_ema must be in [0, 1)")

    def member_config(self, i: int) -> TrainConfig:
        m = self.members[i]
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}
        base["run"] = dataclasses.replace(self.run, name=m.name, output_dir=str(Path(self.run.output_dir) / m.name))
        base["model"] = m.model
        base["optim"] = m.optim or self.optim
        return TrainConfig(**base)


def load_cotrain_config(path: str | Path, overrides: dict[str, Any] | None = None) -> CotrainConfig:
    return load_config(CotrainConfig, path, overrides, "cotrain config")


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
        self.compat: dict[tuple[int, int], float] = {}

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
        import time

        # Each member's step time counts its own work only (its collect, then its receive
        # and update), not the other members' rollouts, so it compares with a lone GRPO run.
        collect_s = [0.0] * len(self.trainers)
        datas = []
        for i, t in enumerate(self.trainers):
            start = time.perf_counter()
            d = t.collect()
            t.record(d.groups)
            datas.append(d)
            collect_s[i] = time.perf_counter() - start
        kn = [{g.prompt.id: (g.k, g.n) for g in d.groups} for d in datas]
        if len({tuple(sorted(k)) for k in kn}) != 1:
            raise RuntimeError("members sampled different prompt batches; their data or seed differ")
        by_prompt = [{g.prompt.id: g for g in d.groups} for d in datas]
        sources = select_sources(kn, self.cfg.graft.balance == "pairwise", self.compat)
        rows = []
        for r, t in enumerate(self.trainers):
            own_start = time.perf_counter()
            offers = {}
            for pid, s in sources[r].items():
                src = self.trainers[s]
                offers[pid] = to_record(by_prompt[s][pid], src.step, src.model_id, src.tok_id, src.run_id)
            extra: dict[str, Any] = {}
            for s, other in enumerate(self.trainers):
                if s != r:
                    c, v = complementarity(datas[r].groups, [kn[s]])
                    n_sel = sum(1 for x in sources[r].values() if x == s)
                    extra.update({k.replace("graft/", f"graft/from/{other.model_id}/"): val
                                  for k, val in offer_metrics(datas[r].groups, c, v, n_sel).items()})
            cands, solved = complementarity(datas[r].groups, [kn[s] for s in range(len(kn)) if s != r])
            extra.update(offer_metrics(datas[r].groups, cands, solved, len(offers)))
            result = receive(t, datas[r].groups, offers)
            extra.update(result.metrics)
            for s, other in enumerate(self.trainers):
                key = f"graft/from/{other.model_id}/s_mean"
                if key in result.metrics and math.isfinite(result.metrics[key]):
                    prev = self.compat.get((s, r))
                    a = self.cfg.compat_ema
                    self.compat[(s, r)] = result.metrics[key] if prev is None else a * prev + (1 - a) * result.metrics[key]
            rows.append(t.finish_step(datas[r], result.groups, extra, own_start - collect_s[r]))
        return rows

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



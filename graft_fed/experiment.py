"""The paper's experiment in miniature: for each pair of models, GRPO n=8, GRPO n=16,
GRAFT co-trained, GRAFT from stored trajectories and ablations, over several seeds, each
final model evaluated on a held-out test split; a Markdown report in the paper's layout
and PNG plots.

Every arm is an ordinary run (train or cotrain) in its own folder; a finished run has a
summary.json and is skipped on re-invocation, so the experiment resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from graft_fed.configbase import deep_merge, from_mapping, load_yaml, require, to_dict
from graft_fed.errors import ConfigError
from graft_fed.trainer.config import AlgorithmSection, GraftSection, ModelSection, TrainConfig, member_seed

if TYPE_CHECKING:
    from graft_fed.graft.cotrain import CotrainConfig

log = logging.getLogger("graft_fed.experiment")

# Ablation arms: name -> (graft overrides, algorithm overrides). Each is one config switch.
ABLATIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "graft": ({}, {}),
    "no_gate": ({"gate": False}, {}),
    "delta0": ({"delta": 0.0}, {}),
    "no_balance": ({"balance": "none"}, {}),
    "peer_first": ({"order": "peer_first"}, {}),
    "shuffled": ({"order": "shuffled"}, {}),
    "pooled": ({"transfer": "pooled"}, {}),
    "success_only": ({"transfer": "success_only"}, {}),
    "seq_ratio": ({}, {"ratio": "sequence"}),
}
BASELINES = ("grpo_n8", "grpo_n16")
# Arms that co-train every model of `models` together (folder `all`): graft_all is the
# in-process equivalent of a synchronous federation of them (the broker uses the same
# selection, core.exchange.select_sources; tests/federation/test_two_node_equivalence.py pins
# federation == co-training), against each receiver's best pairwise partner. The others are
# settings of the same co-training (issue 15): a random peer per prompt instead of the
# compatibility matching; gate off; and "SFT on peer successes" at matched compute (the same
# rollouts, selection and optimiser steps as graft_all, training only on the peers'
# successful responses, with no gate: graft.transfer success_only, graft.gate false).
GROUP_ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "graft_all": ({}, {}),
    "graft_random": ({"source_choice": "random"}, {}),
    "no_gate_all": ({"gate": False}, {}),
    "sft_peer": ({"transfer": "success_only", "gate": False}, {}),
}
# replay: each model alone, its all-fail groups replaced by its own earlier informative groups
# for the same prompts (graft/replay.py; a replay-buffer baseline).
SINGLE_ARMS = ("replay",)
ARMS = BASELINES + ("stored",) + tuple(GROUP_ARMS) + SINGLE_ARMS + tuple(ABLATIONS)


@dataclass(frozen=True)
class ExperimentConfig:
    """The miniature experiment (bench/paper_miniature.yaml)."""

    #: Where every run and the report go.
    output_dir: str = "runs/miniature"
    #: Seeds; each arm runs once per seed.
    seeds: tuple[int, ...] = (0, 1, 2)
    #: name -> model spec (zoo:<name> or a path), with its prompt template.
    models: Mapping[str, Any] = field(default_factory=dict)
    #: Pairs of model names, each trained together in the GRAFT arms.
    pairs: tuple[tuple[str, str], ...] = ()
    #: Arms to run: grpo_n8, grpo_n16, stored, replay, any of the ablations (graft, no_gate, ...)
    #: on each pair, and graft_all, graft_random, no_gate_all, sft_peer on all models together.
    arms: tuple[str, ...] = ("grpo_n8", "grpo_n16", "graft", "stored", "no_gate")
    #: The run config every arm starts from (model and output_dir are set per run).
    base: Mapping[str, Any] = field(default_factory=dict)
    #: An eval section (as `base.eval`) for the test split. When set, `base.eval` is the
    #: validation set scored every `run.eval_every` steps, and each finished run's final
    #: checkpoint and best-validation checkpoint (highest validation pass@1, the earliest on a
    #: tie; the paper reports that one) are scored on this set (summary.json `test`).
    #: Checkpoints are then kept at every evaluation (run.checkpoint_every = run.eval_every)
    #: until the run is scored, then pruned to those two.
    test_eval: Mapping[str, Any] | None = None
    #: model name -> its withheld task families (its primary metric: pass@1 on those).
    withheld: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The model whose scratchpad style the others find implausible (for the gate claim).
    implausible: str | None = None

    def __post_init__(self) -> None:
        require(len(self.seeds) >= 1, "experiment.seeds must hold at least one seed")
        require(len(self.models) >= 2, "experiment.models must name at least two models")
        for a, b in self.pairs:
            require(a in self.models and b in self.models and a != b,
                    f"pair ({a}, {b}) must name two different models of experiment.models")
        unknown = [a for a in self.arms if a not in ARMS]
        require(not unknown, f"unknown arms {unknown}; choose from {list(ARMS)}")
        require("stored" not in self.arms or "grpo_n8" in self.arms,
                "the stored arm learns from the grpo_n8 runs' trajectories: add grpo_n8 to arms")
        for m in self.withheld:
            require(m in self.models, f"experiment.withheld names {m!r}, which is not in experiment.models")
        require(self.implausible is None or self.implausible in self.models,
                f"experiment.implausible {self.implausible!r} is not in experiment.models")
        if self.test_eval is not None:
            run = self.base.get("run", {})
            require(int(run.get("eval_every", 0)) > 0,
                    "experiment.test_eval scores the best-validation checkpoint: set base.run.eval_every > 0")
            scored = (self.test_eval.get("data") or {}).get("families")
            for m, fams in self.withheld.items():
                missing = [f for f in fams if scored is not None and f not in scored]
                require(not missing, f"experiment.withheld[{m!r}] names {missing}, which test_eval.data.families "
                                     f"({list(scored or [])}) does not score: add them there")


def load_experiment_config(path: str | Path, quick: bool = False) -> ExperimentConfig:
    data = load_yaml(path)
    quick_over = data.pop("quick", None)
    if quick and quick_over:
        for key, value in quick_over.items():
            if key == "base":
                data["base"] = deep_merge(data.get("base", {}), value)
            else:
                data[key] = value
    try:
        return from_mapping(ExperimentConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"invalid experiment config {path}: {exc}") from None


def _model_section(spec: Any) -> dict[str, Any]:
    return {"path": spec} if isinstance(spec, str) else dict(spec)


class Experiment:
    def __init__(self, cfg: ExperimentConfig, quiet: bool = True) -> None:
        self.cfg = cfg
        self.root = Path(cfg.output_dir)
        self.quiet = quiet
        # Validate the base config once, up front, with a placeholder model.
        self._train_cfg("validate", "x", next(iter(cfg.models)), 0)

    def _train_cfg(self, arm: str, run_name: str, model: str, seed: int, group: bool = False,
                   **over: Any) -> TrainConfig:
        """A run of experiment seed `seed`: the prompt schedule's seed is `seed`, and model
        `model` samples with member_seed(seed, model) whether it trains alone or co-trained
        (a co-training run derives its members' seeds itself: `group`), so every arm of a
        seed shares the same random numbers per model."""
        own = seed if group else member_seed(seed, model)
        base = deep_merge(self.cfg.base, {
            "run": {"name": run_name, "output_dir": str(self.root / arm / f"seed{seed}" / run_name), "seed": own,
                    "schedule_seed": seed},
            "model": _model_section(self.cfg.models[model]),
        })
        base = deep_merge(base, over)
        if self.cfg.test_eval is not None:
            every = int(base["run"]["eval_every"])
            base = deep_merge(base, {"run": {"checkpoint_every": every, "keep_checkpoints": 10_000}})
        return from_mapping(TrainConfig, base)

    def _done(self, out_dir: Path) -> bool:
        return (out_dir / "summary.json").is_file()

    def run_single(self, arm: str, run_name: str, model: str, seed: int, **over: Any) -> None:
        from graft_fed.graft import step as graft_step
        from graft_fed.graft import stored
        from graft_fed.graft.replay import ReplayPeers
        from graft_fed.trainer.grpo import GRPOTrainer

        cfg = self._train_cfg(arm, run_name, model, seed, **over)
        # The model id (what peers and the store call it) is the model's name, whatever the folder.
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=model))
        if self._done(Path(cfg.run.output_dir)):
            self.score_test(Path(cfg.run.output_dir), model)
            return
        log.info("%s seed %d: %s", arm, seed, run_name)
        with GRPOTrainer(cfg, resume="auto", quiet=self.quiet) as t:
            if arm == "replay":
                replay = ReplayPeers()
                t.train(step_fn=lambda: graft_step.step(t, replay))
            else:
                stored.train(t)
        self.score_test(Path(cfg.run.output_dir), model)

    def run_pair(self, arm: str, a: str, b: str, seed: int) -> None:
        self.run_group(arm, (a, b), f"{a}+{b}", seed)

    def group_config(self, arm: str, names: tuple[str, ...], folder: str, seed: int, out: Path,
                     silent: tuple[str, ...] = ()) -> "CotrainConfig":
        """The co-training config of a group or pair arm, writing to `out`; members named in
        `silent` offer nothing (bench/group_arm_without.py's diagnostic)."""
        from graft_fed.graft.cotrain import CotrainConfig, MemberSection

        g_over, alg_over = GROUP_ARMS[arm] if arm in GROUP_ARMS else ABLATIONS.get(arm, ({}, {}))
        base = self._train_cfg(arm, folder, names[0], seed, group=True, graft=g_over, algorithm=alg_over)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TrainConfig)}
        fields["run"] = dataclasses.replace(base.run, output_dir=str(out))
        members = tuple(MemberSection(name=m, model=from_mapping(ModelSection, _model_section(self.cfg.models[m])),
                                      shares=m not in silent) for m in names)
        return CotrainConfig(**fields, members=members)

    def run_group(self, arm: str, names: tuple[str, ...], folder: str, seed: int) -> None:
        from graft_fed.graft.cotrain import CoTrainer

        out = self.root / arm / f"seed{seed}" / folder
        if all(self._done(out / m) for m in names):
            for m in names:
                self.score_test(out / m, m)
            return
        log.info("%s seed %d: %s", arm, seed, folder)
        with CoTrainer(self.group_config(arm, names, folder, seed, out), resume="auto", quiet=self.quiet) as co:
            co.train()
        for m in names:
            self.score_test(out / m, m)

    def score_test(self, run: Path, model: str) -> dict[str, Any] | None:
        """With `test_eval` set: score a finished run's final checkpoint and its best-validation
        checkpoint on the test set, record both (and the validation curve) in summary.json
        under `test`, then delete the run's other checkpoints. Idempotent: a run already
        scored with this test set is left alone."""
        if self.cfg.test_eval is None or not self._done(run):
            return None
        from graft_fed.trainer import checkpoint as ckpt
        from graft_fed.trainer.config import EvalSection

        want = from_mapping(EvalSection, self.cfg.test_eval)
        path = run / "summary.json"
        summary = json.loads(path.read_text(encoding="utf-8"))
        if summary.get("test", {}).get("eval_config") == to_dict(want):
            return summary["test"]
        curve = validation_curve(run)
        if not curve:
            raise ConfigError(f"{run} has no periodic validation evaluation (run.eval_every) to select from")
        best_step = max(curve, key=lambda row: (row["pass@1"], -row["step"]))["step"]
        final_step = curve[-1]["step"]
        by_step = {ckpt.checkpoint_step(d): d for d in ckpt.checkpoint_dirs(run / "checkpoints")}
        result: dict[str, Any] = {"eval_config": to_dict(want), "validation": curve}
        for name, step in (("final", final_step), ("best_val", best_step)):
            if step == 0:
                model_dir = Path(str(_model_section(self.cfg.models[model])["path"]))
            elif step in by_step:
                ckpt.verify_checkpoint(by_step[step])
                model_dir = by_step[step] / "model"
            else:
                raise ConfigError(f"{run}: the checkpoint of step {step} is missing; cannot score it on the test set")
            if name == "best_val" and step == final_step:
                result[name] = {**result["final"]}
                continue
            result[name] = {"step": step, **self._evaluate_model(run, model_dir, want).summary()}
        summary["test"] = result
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        os.replace(tmp, path)
        import shutil

        for step, d in by_step.items():
            if step not in (final_step, best_step):
                shutil.rmtree(d, ignore_errors=True)
        return result

    def _evaluate_model(self, run: Path, model_dir: Path, want: Any) -> Any:
        """An EvalResult of `model_dir` with the eval settings `want`, keeping the run's own
        model template, verifier, rollout batch size and thread count."""
        from graft_fed.data.config import load_prompts
        from graft_fed.evaluation import evaluate
        from graft_fed.modeling import load_model_and_tokenizer
        from graft_fed.rewards import build_verifier
        from graft_fed.trainer.config import load_train_config

        run_cfg = load_train_config(run / "config.json")
        if run_cfg.run.threads:
            import torch

            torch.set_num_threads(run_cfg.run.threads)
        model, tok = load_model_and_tokenizer(str(model_dir), "cpu")
        with build_verifier(run_cfg.verifier) as verifier:
            res = evaluate(model, tok, load_prompts(want.data), verifier, template=run_cfg.model.template,
                           add_special_tokens=run_cfg.model.encode_special_tokens, k=want.k,
                           temperature=want.temperature, top_p=want.top_p,
                           max_new_tokens=want.max_new_tokens or run_cfg.rollout.max_new_tokens,
                           seed=want.seed, batch_size=run_cfg.rollout.batch_size, seeding=want.seeding)
        return res

    def run_stored(self, receiver: str, peer: str, seed: int) -> None:
        """The paper's stored mode: the receiver learns from the peer's own GRPO n=8 run of the
        same seed (hence the same prompt schedule), every candidate, one direction."""
        store = self.root / "grpo_n8" / f"seed{seed}" / peer / "trajectories.sqlite"
        if not store.is_file():
            raise ConfigError(f"the stored arm needs {peer}'s GRPO n=8 run of seed {seed} ({store} is missing): "
                              "run the grpo_n8 arm first (`--arms stored` runs it where it is missing)")
        self.run_single("stored", f"{receiver}<-{peer}", receiver, seed,
                        graft={"peer_store": str(store), "balance": "none"})

    def reevaluate(self) -> int:
        """Score every finished run's final checkpoint again with the config's `eval` section
        where the run was evaluated otherwise (e.g. a larger test split, keyed sampling),
        without retraining; returns the number of runs re-scored. The run's own model
        template, verifier and rollout batch size are kept. Re-scoring with the settings a
        run was evaluated with gives the same result (keyed sampling) or an equivalent draw."""
        from graft_fed.evaluation import write_eval
        from graft_fed.trainer import checkpoint as ckpt
        from graft_fed.trainer.config import EvalSection, load_train_config

        want = from_mapping(EvalSection, self.cfg.base.get("eval", {}))
        want_dict = to_dict(want)
        done = 0
        for _, _, run in run_paths(self.cfg, self.cfg.arms):
            path = run / "summary.json"
            if not path.is_file():
                continue
            summary = json.loads(path.read_text(encoding="utf-8"))
            run_cfg = load_train_config(run / "config.json")
            if summary.get("eval_config", to_dict(run_cfg.eval)) == want_dict:
                continue
            checkpoints = ckpt.checkpoint_dirs(run / "checkpoints")
            if not checkpoints:
                raise ConfigError(f"{run} has no checkpoint to evaluate again (its checkpoints were deleted)")
            final = checkpoints[-1]
            ckpt.verify_checkpoint(final)
            log.info("re-evaluating %s", final)
            result = self._evaluate_model(run, final / "model", want)
            write_eval(result, run / "eval", final.name)
            summary["eval_after"] = result.summary()
            summary["eval_config"] = want_dict
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
            os.replace(tmp, path)
            done += 1
        return done

    def models_in_pairs(self) -> list[str]:
        return sorted({m for p in self.cfg.pairs for m in p})

    def run(self) -> Path:
        t0 = time.perf_counter()
        arms = self.cfg.arms
        for seed in self.cfg.seeds:
            for model in self.models_in_pairs():
                if "grpo_n8" in arms:
                    self.run_single("grpo_n8", model, model, seed, rollout={"n": 8})
                if "grpo_n16" in arms:
                    self.run_single("grpo_n16", model, model, seed, rollout={"n": 16})
                if "replay" in arms:
                    self.run_single("replay", model, model, seed)
            for a, b in self.cfg.pairs:
                for arm in arms:
                    if arm in ABLATIONS:
                        self.run_pair(arm, a, b, seed)
                if "stored" in arms:
                    self.run_stored(a, b, seed)
                    self.run_stored(b, a, seed)
            for arm in GROUP_ARMS:
                if arm in arms:
                    self.run_group(arm, tuple(sorted(self.cfg.models)), "all", seed)
        (self.root / "timing.json").write_text(json.dumps({"seconds_this_invocation": time.perf_counter() - t0}))
        return write_report(self.cfg)


# ----- the report -----------------------------------------------------------------------------

def _final_eval(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / "summary.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())["eval_after"]


def _pass1(ev: dict[str, Any], family: str | None = None) -> float | None:
    if family is None:
        return ev["pass@1"]
    return (ev.get("by_group") or {}).get(family)


def run_paths(cfg: ExperimentConfig, arms: tuple[str, ...] | None = None
              ) -> list[tuple[tuple[str, str, str], int, Path]]:
    """Every run folder of the config as ((receiver, peer, arm), seed, path), for `arms` (default:
    every arm there is). Baselines have peer '-', graft_all has peer 'all'."""
    root = Path(cfg.output_dir)
    wanted = set(ARMS if arms is None else arms)
    out: list[tuple[tuple[str, str, str], int, Path]] = []
    for seed in cfg.seeds:
        s = f"seed{seed}"
        for m in sorted({x for p in cfg.pairs for x in p}):
            out += [((m, "-", arm), seed, root / arm / s / m) for arm in BASELINES + SINGLE_ARMS if arm in wanted]
        for a, b in cfg.pairs:
            for recv, peer in ((a, b), (b, a)):
                out += [((recv, peer, arm), seed, root / arm / s / f"{a}+{b}" / recv)
                        for arm in ABLATIONS if arm in wanted]
                if "stored" in wanted:
                    out.append(((recv, peer, "stored"), seed, root / "stored" / s / f"{recv}<-{peer}"))
        for arm in GROUP_ARMS:
            if arm in wanted:
                out += [((m, "all", arm), seed, root / arm / s / "all" / m) for m in sorted(cfg.models)]
    return out


def validation_curve(run: Path) -> list[dict[str, Any]]:
    """Every evaluation a run wrote during training (eval/step_*.summary.json), in step order:
    [{"step", "pass@1", "by_group"}]."""
    rows = []
    for f in sorted((run / "eval").glob("step_*.summary.json")):
        ev = json.loads(f.read_text(encoding="utf-8"))
        rows.append({"step": int(f.name.split(".")[0].rsplit("_", 1)[-1]), "pass@1": ev["pass@1"],
                     "by_group": ev.get("by_group") or {}})
    return rows


def collect_by_seed(cfg: ExperimentConfig, family: str | dict[str, str] | None = None
                    ) -> dict[tuple[str, str, str], dict[int, float]]:
    """(receiver, peer, arm) -> {seed: final pass@1}. Baselines have peer '-'.

    `family` restricts the score to one task family (the eval's per-family pass@1), either one
    name for every receiver or a {receiver: family} map."""
    res: dict[tuple[str, str, str], dict[int, float]] = {}
    for key, seed, path in run_paths(cfg):
        ev = _final_eval(path)
        fam = family.get(key[0]) if isinstance(family, dict) else family
        v = None if ev is None else _pass1(ev, fam)
        if v is not None:
            res.setdefault(key, {})[seed] = v
    return res


def _in_seed_order(by_seed: dict[tuple[str, str, str], dict[int, float]]) -> dict[tuple[str, str, str], list[float]]:
    return {k: [v[s] for s in sorted(v)] for k, v in by_seed.items()}


def collect_results(cfg: ExperimentConfig, family: str | dict[str, str] | None = None
                    ) -> dict[tuple[str, str, str], list[float]]:
    """(receiver, peer, arm) -> final pass@1 per finished seed, in seed order (see collect_by_seed)."""
    return _in_seed_order(collect_by_seed(cfg, family))


def _has_pairs(by_seed: dict[tuple[str, str, str], dict[int, float]]) -> bool:
    return any(paired_deltas(by_seed, r, p, a) for (r, p, a) in by_seed if a != "grpo_n8")


def paired_deltas(by_seed: dict[tuple[str, str, str], dict[int, float]], receiver: str, peer: str,
                  arm: str) -> dict[int, float]:
    """{seed: pass@1 of the arm minus GRPO n=8 of the same receiver and seed}, over the seeds both
    finished. With keyed rollouts and evaluation (rollout/eval seeding: prompt) the two runs of
    a seed share their randomness, so this difference is far less noisy than a difference of
    means over seeds."""
    base = by_seed.get((receiver, "-", "grpo_n8"), {})
    key = (receiver, "-", arm) if arm in BASELINES else (receiver, peer, arm)
    other = by_seed.get(key, {})
    return {s: other[s] - base[s] for s in sorted(set(base) & set(other))}


def _fmt_delta(deltas: list[float]) -> str:
    """'+1.2 ± 0.5 (3/4)': mean paired difference in points ± its standard error over seeds, and
    how many seeds are above GRPO n=8."""
    if not deltas:
        return "n/a"
    mean = 100 * statistics.fmean(deltas)
    se = 100 * statistics.stdev(deltas) / len(deltas) ** 0.5 if len(deltas) > 1 else float("nan")
    wins = sum(d > 0 for d in deltas)
    return f"{mean:+.1f} ± {se:.1f} ({wins}/{len(deltas)})"


def pairing_gain(by_seed: dict[tuple[str, str, str], dict[int, float]]) -> tuple[float, int] | None:
    """Median over cells (receiver, peer, arm with >= 3 paired seeds) of the standard deviation
    of the seed-by-seed differences divided by the one independent runs would give
    (sqrt(var(arm) + var(GRPO n=8)) over the same seeds): below 1 when pairing removes noise."""
    ratios = []
    for (recv, peer, arm), values in by_seed.items():
        if arm == "grpo_n8":
            continue
        d = paired_deltas(by_seed, recv, peer, arm)
        if len(d) < 3:
            continue
        base = by_seed[(recv, "-", "grpo_n8")]
        independent = math.sqrt(statistics.variance([base[s] for s in d]) + statistics.variance([values[s] for s in d]))
        if independent > 0:
            ratios.append(statistics.stdev(d.values()) / independent)
    return (statistics.median(ratios), len(ratios)) if ratios else None


def _paired_tables(cfg: ExperimentConfig, by_seed: dict[tuple[str, str, str], dict[int, float]],
                   arms: list[str]) -> list[str]:
    """Per receiver and peer, then per receiver over its peers: arm minus GRPO n=8, seed by seed."""
    cols = [a for a in ["grpo_n16"] if a in cfg.arms] + arms
    lines = ["| receiver | peer | " + " | ".join(f"Δ {a}" for a in cols) + " |", "|---|---|" + "---|" * len(cols)]
    per_recv: dict[tuple[str, str], dict[int, list[float]]] = {}
    for a, b in cfg.pairs:
        for recv, peer in ((a, b), (b, a)):
            cells = []
            for arm in cols:
                d = paired_deltas(by_seed, recv, peer, arm)
                cells.append(_fmt_delta(list(d.values())))
                if arm not in BASELINES:
                    for seed, v in d.items():
                        per_recv.setdefault((recv, arm), {}).setdefault(seed, []).append(v)
            lines.append(f"| {recv} | {peer} | " + " | ".join(cells) + " |")
    lines += ["", "Per receiver, averaged over its peers (a seed's difference is the mean over the peers "
              "whose runs of that seed finished):", "",
              "| receiver | " + " | ".join(f"Δ {a}" for a in cols) + " |", "|---|" + "---|" * len(cols)]
    for recv in sorted({m for p in cfg.pairs for m in p}):
        cells = []
        for arm in cols:
            if arm in BASELINES:
                d = list(paired_deltas(by_seed, recv, "-", arm).values())
            else:
                d = [statistics.fmean(v) for _, v in sorted(per_recv.get((recv, arm), {}).items())]
            cells.append(_fmt_delta(d))
        lines.append(f"| {recv} | " + " | ".join(cells) + " |")
    return lines


def _fmt(values: list[float] | None) -> str:
    if not values:
        return "n/a"
    mean = 100 * statistics.fmean(values)
    sd = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {sd:.1f}"


def weakest_families(cfg: ExperimentConfig) -> dict[str, str]:
    """Per model: the task family with the lowest mean GRPO n=8 pass@1 over seeds ({} without
    per-family scores)."""
    root = Path(cfg.output_dir)
    out: dict[str, str] = {}
    for m in {x for p in cfg.pairs for x in p}:
        per: dict[str, list[float]] = {}
        for seed in cfg.seeds:
            ev = _final_eval(root / "grpo_n8" / f"seed{seed}" / m)
            for fam, v in ((ev or {}).get("by_group") or {}).items():
                per.setdefault(fam, []).append(v)
        if per:
            out[m] = min(sorted(per), key=lambda f: statistics.fmean(per[f]))
    return out


def _pair_table(cfg: ExperimentConfig, res: dict[tuple[str, str, str], list[float]],
                arms: list[str]) -> list[str]:
    header = ["receiver", "peer", "GRPO n=8", "GRPO n=16"] + list(arms) + [f"Δ {a}" for a in arms]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for a, b in cfg.pairs:
        for recv, peer in ((a, b), (b, a)):
            n8 = res.get((recv, "-", "grpo_n8"))
            row = [recv, peer, _fmt(n8), _fmt(res.get((recv, "-", "grpo_n16")))]
            row += [_fmt(res.get((recv, peer, arm))) for arm in arms]
            for arm in arms:
                v = res.get((recv, peer, arm))
                row.append(f"{100 * (statistics.fmean(v) - statistics.fmean(n8)):+.1f}" if v and n8 else "n/a")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _prompts_per_step(cfg: ExperimentConfig) -> int:
    default = {f.name: f.default for f in dataclasses.fields(AlgorithmSection)}["prompts_per_step"]
    return int(cfg.base.get("algorithm", {}).get("prompts_per_step", default))


def exchange_volume(cfg: ExperimentConfig) -> list[str]:
    """Per receiver and peer of the co-trained arm: all-fail groups, candidates and replaced groups
    per step and the admitted fraction of peer responses, averaged over steps and seeds."""
    root = Path(cfg.output_dir)
    keys = ("graft/all_fail", "graft/candidates", "graft/replaced", "graft/admitted_frac")
    lines = ["| receiver | peer | all-fail / step | candidates / step | replaced / step | admitted |",
             "|---|---|---|---|---|---|"]
    for a, b in cfg.pairs:
        for recv, peer in ((a, b), (b, a)):
            vals: dict[str, list[float]] = {k: [] for k in keys}
            for seed in cfg.seeds:
                path = root / "graft" / f"seed{seed}" / f"{a}+{b}" / recv / "metrics.jsonl"
                if not path.is_file():
                    continue
                for line in path.read_text(encoding="utf-8").splitlines():
                    row = json.loads(line)
                    for k in keys:
                        v = row.get(k)
                        if v is not None:
                            vals[k].append(float(v))
                        elif k != "graft/admitted_frac":
                            vals[k].append(0.0)
            if not vals["graft/all_fail"]:
                continue
            cells = [f"{statistics.fmean(vals[k]):.2f}" if vals[k] else "n/a" for k in keys[:3]]
            adm = vals["graft/admitted_frac"]
            cells.append(f"{100 * statistics.fmean(adm):.0f}%" if adm else "n/a")
            lines.append(f"| {recv} | {peer} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def write_report(cfg: ExperimentConfig) -> Path:
    root = Path(cfg.output_dir)
    by_seed = collect_by_seed(cfg)
    res = _in_seed_order(by_seed)
    arms = [a for a in cfg.arms if a in ABLATIONS or a == "stored"]  # the pair arms
    lines = ["# GRAFT in miniature", "",
             f"Held-out pass@1 (%, mean ± std over seeds {list(cfg.seeds)}) of each receiver after training.",
             "Δ is against GRPO n=8 of the same receiver. Produced by `graft-fed experiment`; config in "
             f"`{root / 'experiment.json'}`.", ""]
    if cfg.test_eval is not None:
        lines += ["With `test_eval` set, the tables up to the withheld-slice section score the final checkpoint on "
                  "`base.eval` (the validation set); the test split's numbers are in that section.", ""]
    lines += _pair_table(cfg, res, arms)
    if _has_pairs(by_seed):
        lines += ["", "## Paired differences", "",
                  "Arm minus GRPO n=8 of the same receiver and seed, in points: mean ± standard error over "
                  "seeds (seeds above GRPO n=8 / seeds). Paired by seed, so with keyed rollouts and "
                  "evaluation (`rollout.seeding: prompt`, `eval.seeding: prompt`) the comparison shares "
                  "the randomness of each seed; read these rather than the Δ of means above.", ""]
        lines += _paired_tables(cfg, by_seed, arms)
        gain = pairing_gain(by_seed)
        if gain:
            lines += ["", f"Spread of the paired differences relative to independent runs (median over {gain[1]} "
                      f"cells with >= 3 seeds): {gain[0]:.2f}."]
    weak = weakest_families(cfg)
    if weak:
        lines += ["", "## On each receiver's weak family", "",
                  "The same runs scored on the receiver's weakest task family only (the family with the lowest "
                  "GRPO n=8 pass@1 over seeds: " + ", ".join(f"{m}: {f}" for m, f in sorted(weak.items()))
                  + "). These are the prompts GRAFT is for: the receiver's all-fail groups sit mostly here.", ""]
        weak_by_seed = collect_by_seed(cfg, family=weak)
        lines += _pair_table(cfg, _in_seed_order(weak_by_seed), arms)
        if _has_pairs(weak_by_seed):
            lines += ["", "Paired differences on the weak family (as above: arm minus GRPO n=8, same seed):", ""]
            lines += _paired_tables(cfg, weak_by_seed, arms)
    volume = exchange_volume(cfg)
    if volume:
        lines += ["", "## Exchange volume (co-trained GRAFT arm)", "",
                  "Per step, averaged over steps and seeds; the receiver's batch has "
                  f"{_prompts_per_step(cfg)} prompts.", ""] + volume
    if cfg.test_eval is not None:
        lines += [""] + selection_report(cfg)
    if "graft_all" in cfg.arms:
        lines += ["", "## Does a third model help?", "",
                  "Each receiver co-trained with all models at once (graft_all; the broker's selection) against "
                  "GRPO n=8 and its best pairwise GRAFT partner (the pair arm `graft` above).", "",
                  "| receiver | GRPO n=8 | best pair (peer) | all models | Δ all vs best pair |", "|---|---|---|---|---|"]
        for m in sorted(cfg.models):
            pairs = [(res[(m, p, "graft")], p) for p in cfg.models if (m, p, "graft") in res]
            best = max(pairs, key=lambda vp: statistics.fmean(vp[0])) if pairs else None
            allv = res.get((m, "all", "graft_all"))
            delta = (f"{100 * (statistics.fmean(allv) - statistics.fmean(best[0])):+.1f}"
                     if allv and best else "n/a")
            lines.append(f"| {m} | {_fmt(res.get((m, '-', 'grpo_n8')))} | "
                         f"{_fmt(best[0]) + ' (' + best[1] + ')' if best else 'n/a'} | {_fmt(allv)} | {delta} |")
    lines += ["", "Seeds per cell: " + ", ".join(f"{k[0]}/{k[1]}/{k[2]}={len(v)}" for k, v in sorted(res.items())),
              ""]
    timing = root / "timing.json"
    if timing.is_file():
        lines.append(f"Wall time of the last invocation: {json.loads(timing.read_text())['seconds_this_invocation']:.0f} s.")
    (root / "experiment.json").write_text(json.dumps(to_dict(cfg), indent=2))
    plots = plot_experiment(cfg)
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    report = root / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report


def plot_experiment(cfg: ExperimentConfig) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from graft_fed.trainer.metrics import read_metrics

    root = Path(cfg.output_dir)
    receivers = sorted({m for p in cfg.pairs for m in p})
    out: list[Path] = []

    def runs_for(recv: str, arm: str) -> list[Path]:
        """The arm's finished runs of `recv` (a run still training would cut every curve short)."""
        return [path for (r, _, _), _, path in run_paths(cfg, (arm,))
                if r == recv and (path / "summary.json").is_file()]

    fig, axes = plt.subplots(1, len(receivers), figsize=(5 * len(receivers), 3.6), squeeze=False)
    for ax, recv in zip(axes[0], receivers):
        for arm in cfg.arms:
            curves = []
            for run in runs_for(recv, arm):
                if (run / "metrics.jsonl").is_file():
                    rows = [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
                    curves.append([r["reward"] for r in rows])
            if curves:
                length = min(len(c) for c in curves)
                mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
                ax.plot(range(1, length + 1), mean, label=arm, linewidth=1.2)
        ax.set_title(f"{recv}: train reward")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = root / "learning_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)

    s_vals, replaced = [], {}
    for recv in receivers:
        for run in runs_for(recv, "graft"):
            if (run / "metrics.jsonl").is_file():
                rows = read_metrics(run / "metrics.jsonl")
                for r in rows:
                    s_vals.extend(r.get("graft/s_values") or [])
                replaced.setdefault(recv, []).append([r.get("graft/replaced", 0) for r in rows if "reward" in r])
    if s_vals:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        delta = GraftSection().delta
        axes[0].hist([min(v, 3.0) for v in s_vals], bins=60)
        axes[0].axvline(delta, color="red", linestyle="--", label=f"delta = {delta}")
        axes[0].set_title("compatibility s of peer responses (GRAFT arm; clipped at 3)")
        axes[0].legend()
        for recv, curves in replaced.items():
            length = min(len(c) for c in curves)
            axes[1].plot(range(1, length + 1), [statistics.fmean(c[i] for c in curves) for i in range(length)],
                         label=recv)
        axes[1].set_title("groups replaced per step (mean over seeds)")
        axes[1].set_xlabel("step")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = root / "exchange.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


# ----- the withheld-slice report (test_eval set: final, best validation, area under the curve) -------

def _slice_mean(by_group: Mapping[str, float], families: tuple[str, ...] | None) -> float | None:
    if not families:
        return None
    vals = [by_group.get(f) for f in families]
    return None if any(v is None for v in vals) else statistics.fmean(vals)  # type: ignore[arg-type]


def selection_scores(cfg: ExperimentConfig, path: Path, receiver: str) -> dict[str, float] | None:
    """A scored run's numbers: test pass@1 on the receiver's withheld slice and on the whole test
    split, at the final and at the best-validation checkpoint, and the area under the validation
    curve (the mean over evaluation points, step 0 included when evaluated) on the slice and
    overall. None for a run not scored yet."""
    sp = path / "summary.json"
    if not sp.is_file():
        return None
    test = json.loads(sp.read_text(encoding="utf-8")).get("test")
    if not test:
        return None
    fams = tuple(cfg.withheld.get(receiver, ()))
    out: dict[str, float] = {}
    for which in ("final", "best_val"):
        out[f"{which}/all"] = test[which]["pass@1"]
        v = _slice_mean(test[which].get("by_group") or {}, fams)
        if v is not None:
            out[f"{which}/withheld"] = v
    curve = test.get("validation") or []
    if curve:
        out["auc/all"] = statistics.fmean(r["pass@1"] for r in curve)
        sl = [_slice_mean(r["by_group"], fams) for r in curve]
        if sl and all(v is not None for v in sl):
            out["auc/withheld"] = statistics.fmean(sl)  # type: ignore[arg-type]
        out["best_val/step"] = float(test["best_val"]["step"])
    return out


def collect_selection(cfg: ExperimentConfig, metric: str) -> dict[tuple[str, str, str], dict[int, float]]:
    """(receiver, peer, arm) -> {seed: value of `metric`} (a key of selection_scores)."""
    res: dict[tuple[str, str, str], dict[int, float]] = {}
    for key, seed, path in run_paths(cfg):
        sc = selection_scores(cfg, path, key[0])
        if sc and metric in sc:
            res.setdefault(key, {})[seed] = sc[metric]
    return res


def _diff(by_seed: dict[tuple[str, str, str], dict[int, float]], a: tuple[str, str, str],
          b: tuple[str, str, str]) -> list[float]:
    x, y = by_seed.get(a, {}), by_seed.get(b, {})
    return [x[s] - y[s] for s in sorted(set(x) & set(y))]


def _fmt_diff(d: list[float]) -> str:
    if not d:
        return "not yet measured"
    mean = 100 * statistics.fmean(d)
    se = 100 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return f"{mean:+.1f} ± {se:.1f} ({sum(v > 0 for v in d)}/{len(d)} seeds ahead)"


def claims(cfg: ExperimentConfig, metric: str = "best_val/withheld") -> list[str]:
    """The paper's claims, as issue 15 states them, each met / not met / not yet measured, on
    `metric` (default: the withheld slice at the best-validation checkpoint). A claim is met
    when it holds for every receiver; each receiver's own verdict is given beside its numbers
    (a setting's receivers need not all have the paper's premise)."""
    by = collect_selection(cfg, metric)
    receivers = sorted(cfg.withheld) or sorted(cfg.models)
    lines = [f"Metric: `{metric}` (points; paired by seed: mean ± standard error, seeds ahead).", ""]

    def verdict(ok: bool | None) -> str:
        return "not yet measured" if ok is None else ("met" if ok else "not met")

    # 1. GRAFT n=8 (all peers) beats GRPO n=16 on the withheld slices.
    rows, oks = [], []
    for r in receivers:
        d = _diff(by, (r, "all", "graft_all"), (r, "-", "grpo_n16"))
        oks.append(None if not d else statistics.fmean(d) > 0)
        rows.append(f"{r} {_fmt_diff(d)}" + (f": {verdict(oks[-1])}" if d else ""))
    ok1 = None if any(o is None for o in oks) else all(oks)
    lines.append(f"1. GRAFT n=8 (all peers) beats GRPO n=16 on every receiver's withheld slice: **{verdict(ok1)}** "
                 f"(graft_all minus grpo_n16: {'; '.join(rows)})")
    # 2. Stored keeps >= 85% of the co-trained gain (pair arms, per receiver and peer).
    rows, oks = [], []
    for a, b in cfg.pairs:
        for r, p in ((a, b), (b, a)):
            g = _diff(by, (r, p, "graft"), (r, "-", "grpo_n8"))
            st = _diff(by, (r, p, "stored"), (r, "-", "grpo_n8"))
            if not g or not st:
                oks.append(None)
                continue
            gain, kept = statistics.fmean(g), statistics.fmean(st)
            share = kept / gain if gain > 0 else float("nan")
            rows.append(f"{r}<-{p}: co-trained {100 * gain:+.1f}, stored {100 * kept:+.1f}"
                        + (f" ({100 * share:.0f}%)" if gain > 0 else " (no co-trained gain)"))
            oks.append(gain > 0 and share >= 0.85)
    ok2 = None if not oks or any(o is None for o in oks) else all(oks)
    lines.append(f"2. Stored keeps >= 85% of the co-trained gain: **{verdict(ok2)}** ({'; '.join(rows) or 'no runs'})")
    # 3. Gate-off is worse when the implausible peer is present.
    rows, oks = [], []
    if cfg.implausible:
        for r in receivers:
            if r == cfg.implausible:
                continue
            d = _diff(by, (r, "all", "no_gate_all"), (r, "all", "graft_all"))
            oks.append(None if not d else statistics.fmean(d) < 0)
            rows.append(f"{r} (all peers) no_gate_all minus graft_all {_fmt_diff(d)}" + (f": {verdict(oks[-1])}" if d else ""))
            pair = tuple(sorted((r, cfg.implausible)))
            if pair in {tuple(sorted(p)) for p in cfg.pairs}:
                d = _diff(by, (r, cfg.implausible, "no_gate"), (r, cfg.implausible, "graft"))
                rows.append(f"{r}<-{cfg.implausible} no_gate minus graft {_fmt_diff(d)}")
    ok3 = None if not oks or any(o is None for o in oks) else all(oks)
    lines.append(f"3. Gate-off is worse when the implausible peer ({cfg.implausible}) is present: **{verdict(ok3)}** "
                 f"({'; '.join(rows) or 'no implausible model named'})")
    # 4. All peers with compatibility matching >= the best single peer and > random matching.
    rows, oks = [], []
    for r in receivers:
        singles = {p: by[(r, p, "graft")] for p in cfg.models if (r, p, "graft") in by}
        allv = by.get((r, "all", "graft_all"), {})
        if not singles or not allv:
            oks.append(None)
            continue
        best = max(singles, key=lambda p: statistics.fmean(singles[p].values()))
        d_best = _diff(by, (r, "all", "graft_all"), (r, best, "graft"))
        d_rand = _diff(by, (r, "all", "graft_all"), (r, "all", "graft_random"))
        oks.append(None if not d_best or not d_rand else
                   statistics.fmean(d_best) >= 0 and statistics.fmean(d_rand) > 0)
        rows.append(f"{r}: all minus best single ({best}) {_fmt_diff(d_best)}, all minus random {_fmt_diff(d_rand)}: "
                    f"{verdict(oks[-1])}")
    ok4 = None if not oks or any(o is None for o in oks) else all(oks)
    lines.append(f"4. All peers with compatibility matching >= the best single peer and > random matching: "
                 f"**{verdict(ok4)}** ({'; '.join(rows) or 'no runs'})")
    return lines


def selection_report(cfg: ExperimentConfig) -> list[str]:
    """Per receiver and arm: final / best-validation / AUC on the withheld slice and overall, and
    the arm minus GRPO n=8 paired by seed on the primary metric."""
    metrics = ("final/withheld", "best_val/withheld", "auc/withheld", "final/all", "best_val/all", "auc/all")
    data = {m: collect_selection(cfg, m) for m in metrics}
    keys = sorted({k for d in data.values() for k in d}, key=lambda k: (k[0], ARMS.index(k[2]), k[1]))
    lines = ["## Withheld slices: final, best-validation checkpoint, area under the curve", "",
             "Test pass@1 (%, mean ± std over seeds) of each receiver on its withheld slice "
             "(" + ", ".join(m + ": " + "+".join(f) for m, f in sorted(cfg.withheld.items())) + ") and on the whole "
             "test split, at the final checkpoint and at the checkpoint with the best validation pass@1 "
             "(as the paper reports); AUC is the mean validation pass@1 over the evaluation points.", "",
             "| receiver | peer | arm | seeds | withheld final | withheld best-val | withheld AUC (val) | all final "
             "| all best-val | all AUC (val) | Δ withheld best-val vs GRPO n=8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        cells = [_fmt(list(data[m].get(k, {}).values()) or None) for m in metrics]
        n = max(len(data[m].get(k, {})) for m in metrics)
        d = _diff(data["best_val/withheld"], k, (k[0], "-", "grpo_n8")) if k[2] != "grpo_n8" else []
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {n} | " + " | ".join(cells) + f" | {_fmt_delta(d)} |")
    lines += ["", "### The claims (issue 15), as the paper states its own", ""] + claims(cfg)
    return lines

"""Embedding graft-fed in your own code: a federation node, a co-training run or a plain
GRPO run from Python, with your own reward function and your own dataset.

    from graft_fed.api import run_node

    def my_reward(response: str, answer: str) -> float:   # as TRL reward functions take text
        return float(answer in response)

    summary = run_node({"run": {"output_dir": "runs/me", "steps": 20},
                        "model": {"path": "my/model/dir"},
                        "federation": {"broker": "broker.example.org:50551", "tls_ca": "ca.pem",
                                       "tls_cert": "me.pem", "tls_key": "me.key"}},
                       reward=my_reward, prompts=[{"problem": "2+2?", "answer": "4"}, ...],
                       report_to=["jsonl", "tensorboard"])

`config` is what the YAML file would hold (a dict) or the path of one; every key is in
docs/configuration.md. The reward function runs in the verifier's worker processes, so it
must be a module-level function of an importable module (not a lambda, not defined in
`__main__` run as a script); it is named to the verifier as "module:function", exactly as
`verifier.name` in a config. Prompts are rows {problem, answer} (extra fields such as
level or subject are kept); they are written to a JSONL file in the run's output folder and
become `data.source`, so the run is reproducible from its folder. Every node of a federation
must hold the same training prompts (the broker checks their hash at Join).

Metrics go to `metrics.jsonl` in the run folder always; `report_to` adds "tensorboard"
(pip install 'graft-fed[tensorboard]') and "wandb" (pip install 'graft-fed[wandb]'; offline
unless WANDB_MODE says otherwise: `wandb sync` uploads later), as TRL's `report_to` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from graft_fed.configbase import deep_merge, load_yaml
from graft_fed.errors import ConfigError

REPORT_TO = ("jsonl", "tensorboard", "wandb")


def reward_spec(reward: Callable[[str, str], float] | str) -> str:
    """The verifier name of a reward function: "module:function"."""
    if isinstance(reward, str):
        return reward
    module, name = getattr(reward, "__module__", None), getattr(reward, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise ConfigError(f"reward {reward!r}: give a module-level function (not a lambda, a closure or a method): "
                          "it is imported by name in the verifier's worker processes")
    if module == "__main__":
        raise ConfigError(f"reward {name}: defined in __main__, which the verifier's worker processes cannot "
                          "import; put it in a module of its own and import it from there")
    return f"{module}:{name}"


def write_prompts(rows: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write prompt rows ({problem, answer, ...}) as JSONL, the format `data.source` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            if not isinstance(row, Mapping) or "problem" not in row or "answer" not in row:
                raise ConfigError(f"prompt {n}: expected a mapping with 'problem' and 'answer', got {row!r:.80}")
            fh.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
            n += 1
    if not n:
        raise ConfigError("prompts: the dataset is empty")
    return path


def _prepare(config: Mapping[str, Any] | str | Path, reward, prompts, eval_prompts, report_to: Sequence[str],
             overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    data = load_yaml(config) if isinstance(config, (str, Path)) else json.loads(json.dumps(dict(config)))
    unknown = [r for r in report_to if r not in REPORT_TO]
    if unknown:
        raise ConfigError(f"report_to {unknown}: choose from {list(REPORT_TO)}")
    out_dir = Path(data.get("run", {}).get("output_dir") or "runs/api")
    extra: dict[str, Any] = {"run": {"output_dir": str(out_dir)}}
    if reward is not None:
        extra["verifier"] = {"name": reward_spec(reward)}
    if prompts is not None:
        extra["data"] = {"source": str(write_prompts(prompts, out_dir / "data" / "train.jsonl"))}
    if eval_prompts is not None:
        extra["eval"] = {"data": {"source": str(write_prompts(eval_prompts, out_dir / "data" / "eval.jsonl"))}}
    if "tensorboard" in report_to:
        extra["run"]["tensorboard"] = True
    data = deep_merge(data, extra)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def _write_config(data: Mapping[str, Any], name: str) -> Path:
    out_dir = Path(data["run"]["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False), encoding="utf-8")
    return path


class WandbSink:
    """A metrics writer that also logs each row's numbers to Weights & Biases (offline by
    default: no account or network needed; `wandb sync` uploads the run later)."""

    def __init__(self, inner: Any, run_dir: str | Path, name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("report_to wandb needs Weights & Biases: pip install 'graft-fed[wandb]'") from None
        os.environ.setdefault("WANDB_MODE", "offline")
        self.inner = inner
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "graft-fed"), name=name,
                              dir=str(run_dir), config=dict(config), reinit=True)

    def write(self, row: Mapping[str, Any]) -> None:
        self.inner.write(row)
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k != "step"}
        if numbers:
            self.run.log(numbers, step=int(row.get("step", 0)))

    def close(self) -> None:
        self.inner.close()
        self.run.finish()


def _attach_sinks(trainer: Any, report_to: Sequence[str], data: Mapping[str, Any]) -> None:
    if "wandb" in report_to and getattr(trainer, "is_main", True):
        trainer.metrics = WandbSink(trainer.metrics, trainer.out_dir, trainer.cfg.run.name, data)


def run_node(config: Mapping[str, Any] | str | Path, *, reward: Callable[[str, str], float] | str | None = None,
             prompts: Iterable[Mapping[str, Any]] | None = None,
             eval_prompts: Iterable[Mapping[str, Any]] | None = None, report_to: Sequence[str] = ("jsonl",),
             overrides: Mapping[str, Any] | None = None, resume: str | None = None, evaluate: bool = True,
             join_timeout_s: float = 120.0, quiet: bool = True) -> dict[str, Any]:
    """Run a federation node to the end (as `graft-fed node`) and return its summary."""
    from graft_fed.node.node import Node, load_node_config

    data = _prepare(config, reward, prompts, eval_prompts, report_to, overrides)
    cfg = load_node_config(_write_config(data, "node.yaml"))
    with Node(cfg, resume=resume, quiet=quiet) as node:
        _attach_sinks(node.trainer, report_to, data)
        node.connect(join_timeout_s)
        return node.train(evaluate_before_after=evaluate)  # leaving closes (flushes) every sink


def run_cotrain(config: Mapping[str, Any] | str | Path, *, reward: Callable[[str, str], float] | str | None = None,
                prompts: Iterable[Mapping[str, Any]] | None = None,
                eval_prompts: Iterable[Mapping[str, Any]] | None = None, report_to: Sequence[str] = ("jsonl",),
                overrides: Mapping[str, Any] | None = None, resume: bool = False, evaluate: bool = True,
                quiet: bool = True) -> list[dict[str, Any]]:
    """Co-train the config's members with GRAFT on one machine (as `graft-fed cotrain`);
    returns one summary per member."""
    from graft_fed.graft.cotrain import CoTrainer, load_cotrain_config

    data = _prepare(config, reward, prompts, eval_prompts, report_to, overrides)
    cfg = load_cotrain_config(_write_config(data, "cotrain.yaml"))
    with CoTrainer(cfg, resume="auto" if resume else None, quiet=quiet) as co:
        for trainer in co.trainers:
            _attach_sinks(trainer, report_to, data)
        return co.train(evaluate_before_after=evaluate)


def run_train(config: Mapping[str, Any] | str | Path, *, reward: Callable[[str, str], float] | str | None = None,
              prompts: Iterable[Mapping[str, Any]] | None = None,
              eval_prompts: Iterable[Mapping[str, Any]] | None = None, report_to: Sequence[str] = ("jsonl",),
              overrides: Mapping[str, Any] | None = None, resume: str | None = None,
              evaluate: bool = True, quiet: bool = True) -> dict[str, Any]:
    """One model, plain GRPO or against a stored peer run (graft.peer_store), as `graft-fed
    train`; returns its summary."""
    from graft_fed.graft import stored
    from graft_fed.trainer.config import load_train_config
    from graft_fed.trainer.distributed import make_trainer

    data = _prepare(config, reward, prompts, eval_prompts, report_to, overrides)
    cfg = load_train_config(_write_config(data, "train.yaml"))
    with make_trainer(cfg, resume=resume, quiet=quiet) as trainer:
        _attach_sinks(trainer, report_to, data)
        return stored.train(trainer, evaluate_before_after=evaluate)

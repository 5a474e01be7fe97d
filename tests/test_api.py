"""The Python API (graft_fed/api.py): a node and a co-training run started from Python with
a custom reward function and a custom dataset, and the metrics sinks (report_to)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from graft_fed.api import reward_spec, run_cotrain, run_node, write_prompts
from graft_fed.errors import ConfigError
from tests.federation.helpers import broker_config, start_broker

ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "level": f"L{i % 2}"} for i in range(12)]


def parity_reward(response: str, answer: str) -> float:
    """A custom reward, as a user would write one: text in, a number out."""
    return float(len(response) % 2)


def _base(tmp_path, **over):
    cfg = {"run": {"output_dir": str(tmp_path / "run"), "steps": 2, "seed": 3, "device": "cpu", "threads": 1,
                   "checkpoint_every": 0},
           "rollout": {"n": 2, "max_new_tokens": 4},
           "algorithm": {"prompts_per_step": 4, "num_minibatches": 2},
           "eval": {"k": 2}}
    cfg.update(over)
    return cfg


def test_reward_spec_names_a_module_function_and_refuses_what_workers_cannot_import():
    assert reward_spec(parity_reward) == "tests.test_api:parity_reward"
    with pytest.raises(ConfigError, match="module-level function"):
        reward_spec(lambda r, a: 1.0)
    fn = types.FunctionType(parity_reward.__code__, {}, "main_reward")
    fn.__module__ = "__main__"
    with pytest.raises(ConfigError, match="__main__"):
        reward_spec(fn)


def test_cotrain_from_python_with_a_custom_reward_and_dataset(tiny_llama, tiny_gpt2, tmp_path):
    cfg = _base(tmp_path, members=[{"name": "a", "model": {"path": str(tiny_llama)}},
                                   {"name": "b", "model": {"path": str(tiny_gpt2)}}])
    summaries = run_cotrain(cfg, reward=parity_reward, prompts=ROWS, eval_prompts=ROWS[:4])
    assert len(summaries) == 2 and all("eval_after" in s for s in summaries)
    written = json.loads(json.dumps(__import__("yaml").safe_load((tmp_path / "run" / "cotrain.yaml").read_text())))
    assert written["verifier"]["name"] == "tests.test_api:parity_reward"
    assert (tmp_path / "run" / "data" / "train.jsonl").read_text().count("\n") == 12
    for member in "ab":
        rows = [json.loads(x) for x in (tmp_path / "run" / member / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "reward" in r] == [1, 2]


def test_node_from_python_joins_a_broker_and_reports_its_curve(tiny_llama, tmp_path):
    broker_data = write_prompts(ROWS, tmp_path / "broker" / "train.jsonl")  # same prompts, same dataset id
    server = start_broker(broker_config(broker_data, verifier={"name": "tests.test_api:parity_reward"},
                                        prompts_per_round=4, min_nodes=1))
    try:
        cfg = _base(tmp_path, model={"path": str(tiny_llama)},
                    federation={"broker": server.address, "node_id": "embedded", "match_wait_s": 1.0,
                                "round_timeout_s": 20.0})
        summary = run_node(cfg, reward=parity_reward, prompts=ROWS, eval_prompts=ROWS[:4], join_timeout_s=30)
        assert "eval_after" in summary
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert all(r["federation/connected"] == 1.0 for r in rows if "reward" in r)
        curve = server.servicer.scalars.series()["embedded"]
        assert [r["step"] for r in curve if "reward" in r] == [1, 2]
    finally:
        server.stop()


def test_report_to_wandb_logs_every_row_offline(tiny_llama, tmp_path, monkeypatch):
    logged, finished = [], []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            finished.append(True)

    fake = types.SimpleNamespace(init=lambda **kw: (logged.append(("init", kw)), Run())[1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from graft_fed.api import run_train

    run_train(_base(tmp_path, model={"path": str(tiny_llama)}), reward=parity_reward, prompts=ROWS,
              eval_prompts=ROWS[:4], report_to=["jsonl", "wandb"])
    import os

    assert os.environ.get("WANDB_MODE") == "offline"
    monkeypatch.delenv("WANDB_MODE", raising=False)
    steps = [step for step, values in logged if step != "init" and "reward" in values]
    assert steps == [1, 2] and finished
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # JSONL always


def test_report_to_says_what_to_install(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    from graft_fed.api import run_train

    with pytest.raises(ConfigError, match=r"pip install 'graft-fed\[wandb\]'"):
        run_train(_base(tmp_path, model={"path": str(tiny_llama)}), prompts=ROWS, report_to=["wandb"])
    with pytest.raises(ConfigError, match="report_to"):
        run_train(_base(tmp_path, model={"path": str(tiny_llama)}), prompts=ROWS, report_to=["mlflow"])

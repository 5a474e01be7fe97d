"""A node sharded over 2 processes (torchrun + FSDP2, gloo on CPU) in a 2-node federation
ends as the same node run by one process: only the main process talks to the broker, the
others get the offered groups by broadcast, and all train on the same buffer. Tolerances as
in tests/trainer/test_distributed.py (float summation order only)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import yaml

from graft_fed.configbase import from_mapping
from graft_fed.node.node import Node, NodeConfig
from graft_fed.trainer.config import member_seed
from graft_fed.trainer.metrics import read_metrics
from tests.federation.helpers import broker_config, run_nodes, start_broker
from tests.trainer.test_distributed import compared, ok, torchrun, weights

STEPS = 2


def node_cfg(tmp: Path, name: str, model: str, out: str, address: str) -> dict:
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(f'{{"problem": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(12)))
    return {
        "run": {"name": name, "output_dir": str(tmp / out / name), "steps": STEPS, "seed": member_seed(5, name),
                "schedule_seed": 5, "device": "cpu", "threads": 1, "checkpoint_every": 0, "eval_before": False},
        "model": {"path": model, "template": "chat"},
        "data": {"source": str(prompts)},
        "rollout": {"n": 4, "max_new_tokens": 6, "batch_size": 16, "seeding": "prompt"},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 4, "num_minibatches": 2, "micro_batch_size": 3},
        "optim": {"lr": 1e-2, "eps": 1e-3},
        "federation": {"broker": address, "match_wait_s": 2.0, "round_timeout_s": 60.0, "fetch_timeout_s": 20.0,
                       "reconnect_min_s": 0.1, "reconnect_max_s": 0.5},
    }


def federation(tmp: Path, out: str, sharded: bool) -> None:
    """A broker and the nodes llama and gpt2; llama under torchrun when `sharded`."""
    # every candidate in each direction: with 4 prompts the paired rule (m = min of both
    # directions) would often move nothing
    broker = start_broker(broker_config(tmp / "prompts.jsonl", min_nodes=2, seed=5, n=4, prompts_per_round=4,
                                        balance="none"))
    try:
        llama = node_cfg(tmp, "llama", "zoo:tiny-llama-char", out, broker.address)
        gpt2 = node_cfg(tmp, "gpt2", "zoo:tiny-gpt2-bpe", out, broker.address)
        if not sharded:
            run_nodes([from_mapping(NodeConfig, llama), from_mapping(NodeConfig, gpt2)])
            return
        path = tmp / f"{out}-llama.yaml"
        path.write_text(yaml.safe_dump(llama))
        errors: list[BaseException] = []
        node = Node(from_mapping(NodeConfig, gpt2), quiet=True)

        def other() -> None:
            try:
                with node:
                    node.train(evaluate_before_after=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        ok(torchrun("graft_fed.cli", "node", "--config", str(path), "--no-eval", "--quiet"))
        thread.join(timeout=300)
        if errors:
            raise errors[0]
    finally:
        broker.stop()


@pytest.mark.slow
def test_a_two_process_node_trains_as_a_one_process_node(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(
        "".join(f'{{"problem": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(12)))
    federation(tmp_path, "one", sharded=False)
    federation(tmp_path, "two", sharded=True)
    replaced = 0.0
    for name in ("llama", "gpt2"):
        one = read_metrics(tmp_path / "one" / name / "metrics.jsonl")
        two = read_metrics(tmp_path / "two" / name / "metrics.jsonl")
        assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
        for a, b in zip(one, two):
            assert b["federation/connected"] == 1.0
            a, b = compared(a), compared(b)
            assert a.keys() == b.keys()
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6, nan_ok=True), (name, a["step"], key)
        replaced += sum(r.get("graft/replaced", 0) for r in two)
        want, got = weights(tmp_path / "one" / name, STEPS), weights(tmp_path / "two" / name, STEPS)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
    assert replaced >= 1, "no peer group moved: the equivalence would say nothing about receiving sharded"

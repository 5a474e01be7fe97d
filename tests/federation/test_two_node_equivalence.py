"""A 2-node synchronous federation selects the same prompts and weights, and reaches the
same parameters, as in-process co-training with the same seeds."""

import json

import torch
import yaml

from graft_fed.graft.cotrain import CoTrainer, load_cotrain_config
from tests.federation.helpers import broker_config, node_config, run_nodes, start_broker


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_two_node_federation_equals_cotraining(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    steps = 3
    broker = start_broker(broker_config(prompt_file, min_nodes=2))
    try:
        cfgs = [node_config("llama", tiny_llama, prompt_file, tmp_path / "fed", broker.address, steps=steps),
                node_config("gpt2", tiny_gpt2, prompt_file, tmp_path / "fed", broker.address, steps=steps)]
        run_nodes(cfgs)
        # every received group was reported, and the broker accepted every report (it takes
        # reports only about groups it matched to that receiver in that round)
        reported = sum(c.groups for c in broker.state.compat())
    finally:
        broker.stop()

    co = {
        "run": {"output_dir": str(tmp_path / "co"), "steps": steps, "seed": 3, "device": "cpu", "threads": 1,
                "checkpoint_every": 0},
        "data": {"source": str(prompt_file)},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 8, "num_minibatches": 2},
        "optim": {"lr": 1e-3},
        "members": [{"name": "llama", "model": {"path": str(tiny_llama)}},
                    {"name": "gpt2", "model": {"path": str(tiny_gpt2)}}],
    }
    path = tmp_path / "co.yaml"
    path.write_text(yaml.safe_dump(co))
    with CoTrainer(load_cotrain_config(path), quiet=True) as trainer:
        trainer.train(evaluate_before_after=False)

    exchanged = 0
    for name in ("llama", "gpt2"):
        fed_rows, co_rows = _rows(tmp_path / "fed" / name / "metrics.jsonl"), _rows(tmp_path / "co" / name / "metrics.jsonl")
        assert [r["step"] for r in fed_rows] == [r["step"] for r in co_rows] == list(range(1, steps + 1))
        for f, c in zip(fed_rows, co_rows):
            assert f["federation/connected"] == 1.0 and "federation/report_refused" not in f
            for key in ("graft/selected", "graft/candidates", "graft/all_fail", "reward", "loss"):
                assert f.get(key) == c.get(key), (name, f["step"], key)
            assert f.get("graft/replaced", 0) == c.get("graft/replaced", 0)
            assert f["graft/s_values"] == c["graft/s_values"]  # same admitted responses and weights
            exchanged += f.get("graft/replaced", 0)
        fed_model = sorted((tmp_path / "fed" / name / "checkpoints").iterdir())[-1] / "model"
        co_model = sorted((tmp_path / "co" / name / "checkpoints").iterdir())[-1] / "model"
        from safetensors.torch import load_file

        a = load_file(next(fed_model.glob("*.safetensors")))
        b = load_file(next(co_model.glob("*.safetensors")))
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    assert exchanged > 0, "the fixture produced no exchange; the equivalence would be vacuous"
    assert reported == exchanged

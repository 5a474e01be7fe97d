import json

import yaml

from graft_fed.experiment import Experiment, collect_results, load_experiment_config


def test_miniature_experiment_runs_every_arm_and_reports(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    cfg = {
        "output_dir": str(tmp_path / "exp"),
        "seeds": [0],
        "models": {"llama": str(tiny_llama), "gpt2": str(tiny_gpt2)},
        "pairs": [["llama", "gpt2"]],
        "arms": ["grpo_n8", "grpo_n16", "graft", "stored", "no_gate", "graft_all"],
        "base": {
            "run": {"steps": 1, "device": "cpu", "threads": 1, "checkpoint_every": 0},
            "data": {"source": str(prompt_file)},
            "rollout": {"max_new_tokens": 4},
            "verifier": {"name": "tests.plugins:odd_char_sum"},
            "algorithm": {"prompts_per_step": 4, "num_minibatches": 2},
            "eval": {"data": {"source": str(prompt_file), "max_prompts": 3}, "k": 2},
        },
        "quick": {"seeds": [0]},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    conf = load_experiment_config(path, quick=True)
    report = Experiment(conf).run()
    text = report.read_text()
    assert "| llama | gpt2 |" in text and "| gpt2 | llama |" in text
    res = collect_results(conf)
    for recv, peer in (("llama", "gpt2"), ("gpt2", "llama")):
        for arm in ("graft", "stored", "no_gate"):
            assert len(res[(recv, peer, arm)]) == 1
        assert len(res[(recv, "-", "grpo_n8")]) == 1 and len(res[(recv, "-", "grpo_n16")]) == 1
    n16 = json.loads((tmp_path / "exp" / "grpo_n16" / "seed0" / "llama" / "config.json").read_text())
    assert n16["rollout"]["n"] == 16
    stored = json.loads((tmp_path / "exp" / "stored" / "seed0" / "llama<-gpt2" / "config.json").read_text())
    assert stored["graft"]["peer_store"].endswith("grpo_n8/seed0/gpt2/trajectories.sqlite")
    assert len(res[("llama", "all", "graft_all")]) == 1 and "Does a third model help?" in text
    assert (tmp_path / "exp" / "learning_curves.png").is_file()
    # finished runs are skipped: a second invocation does no training
    mtime = (tmp_path / "exp" / "graft" / "seed0" / "llama+gpt2" / "llama" / "summary.json").stat().st_mtime
    Experiment(conf).run()
    assert (tmp_path / "exp" / "graft" / "seed0" / "llama+gpt2" / "llama" / "summary.json").stat().st_mtime == mtime

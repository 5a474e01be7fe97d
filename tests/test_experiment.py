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


def _write_run(path, pass1, by_group, metrics=()):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"eval_after": {"pass@1": pass1, "by_group": by_group}}))
    if metrics:
        (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_report_scores_the_weak_family_and_the_exchange_volume(tmp_path):
    from graft_fed.experiment import ExperimentConfig, exchange_volume, weakest_families, write_report

    root = tmp_path / "exp"
    conf = ExperimentConfig(output_dir=str(root), seeds=(0, 1), models={"a": "x", "b": "y"},
                            pairs=(("a", "b"),), arms=("grpo_n8", "graft"))
    for seed, (add, sub) in enumerate(((0.9, 0.1), (0.8, 0.3))):
        _write_run(root / "grpo_n8" / f"seed{seed}" / "a", 0.5, {"add": add, "sub": sub})
        _write_run(root / "grpo_n8" / f"seed{seed}" / "b", 0.5, {"add": 0.2, "sub": 0.7})
        steps = [{"graft/all_fail": 4, "graft/candidates": 2, "graft/replaced": 1, "graft/admitted_frac": 0.5},
                 {"graft/all_fail": 2}]  # a step without exchange logs no candidates: counts as 0
        _write_run(root / "graft" / f"seed{seed}" / "a+b" / "a", 0.6, {"add": 0.9, "sub": 0.4}, steps)
        _write_run(root / "graft" / f"seed{seed}" / "a+b" / "b", 0.5, {"add": 0.1, "sub": 0.7}, steps)
    assert weakest_families(conf) == {"a": "sub", "b": "add"}
    weak = collect_results(conf, family=weakest_families(conf))
    assert weak[("a", "-", "grpo_n8")] == [0.1, 0.3] and weak[("a", "b", "graft")] == [0.4, 0.4]
    assert weak[("b", "a", "graft")] == [0.1, 0.1]
    volume = exchange_volume(conf)
    assert "| a | b | 3.00 | 1.00 | 0.50 | 50% |" in volume
    text = write_report(conf).read_text()
    assert "## On each receiver's weak family" in text
    assert "| a | b | 20.0 ± 14.1 | n/a | 40.0 ± 0.0 | +20.0 |" in text  # weak family: sub

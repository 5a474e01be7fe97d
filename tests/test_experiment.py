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


def test_paired_differences_pair_runs_by_seed(tmp_path):
    """Δ is taken seed by seed and only over seeds where both runs finished; the standard error
    is over seeds, and the per-receiver row averages a seed's peers first."""
    from graft_fed.experiment import ExperimentConfig, collect_by_seed, paired_deltas, write_report

    root = tmp_path / "exp"
    conf = ExperimentConfig(output_dir=str(root), seeds=(0, 1, 2), models={"a": "x", "b": "y", "c": "z"},
                            pairs=(("a", "b"), ("a", "c")), arms=("grpo_n8", "graft"))
    base = {0: 0.50, 1: 0.40, 2: 0.60}
    graft_ab = {0: 0.52, 1: 0.43}          # seed 2 unfinished: it must not pair with anything
    graft_ac = {0: 0.49, 1: 0.45, 2: 0.61}
    for s, v in base.items():
        for m in "abc":
            _write_run(root / "grpo_n8" / f"seed{s}" / m, v, {})
    for s, v in graft_ab.items():
        _write_run(root / "graft" / f"seed{s}" / "a+b" / "a", v, {})
        _write_run(root / "graft" / f"seed{s}" / "a+b" / "b", v, {})
    for s, v in graft_ac.items():
        _write_run(root / "graft" / f"seed{s}" / "a+c" / "a", v, {})
    by_seed = collect_by_seed(conf)
    d = paired_deltas(by_seed, "a", "b", "graft")
    assert list(d) == [0, 1] and abs(d[0] - 0.02) < 1e-12 and abs(d[1] - 0.03) < 1e-12
    assert list(paired_deltas(by_seed, "a", "c", "graft")) == [0, 1, 2]
    assert paired_deltas(by_seed, "c", "a", "graft") == {}          # c's side of a+c never ran
    text = write_report(conf).read_text()
    # a <- b: +2.5 ± 0.5 (2/2)
    assert "| a | b | +2.5 ± 0.5 (2/2) |" in text
    # a over its peers: seed 0 mean(+2, -1) = +0.5, seed 1 mean(+3, +5) = +4, seed 2 +1 (c only):
    # mean 1.833, sd 1.893, se 1.093
    assert "| a | +1.8 ± 1.1 (3/3) |" in text
    # one cell has >= 3 paired seeds (a <- c): sd of its differences 0.0306 against
    # sqrt(var(base) + var(graft)) = 0.1301 for independent runs
    from graft_fed.experiment import pairing_gain

    ratio, cells = pairing_gain(by_seed)
    assert cells == 1 and abs(ratio - 0.2349) < 1e-3
    assert "(median over 1 cells with >= 3 seeds): 0.23." in text


def test_reevaluate_rescores_finished_runs_without_training(tiny_llama, prompt_file, tmp_path):
    """--reevaluate scores a finished run's final checkpoint with the config's eval section
    where the run was evaluated otherwise; with keyed evaluation, the same settings reproduce
    the in-training evaluation exactly (the checkpoint holds the weights that were scored)."""
    import dataclasses

    from graft_fed.experiment import ExperimentConfig

    eval_sec = {"data": {"source": str(prompt_file), "max_prompts": 3}, "k": 2, "seeding": "prompt",
                "temperature": 1.0}
    conf = ExperimentConfig(output_dir=str(tmp_path / "exp"), seeds=(0,), models={"llama": str(tiny_llama),
                            "other": str(tiny_llama)}, pairs=(("llama", "other"),), arms=("grpo_n8",),
                            base={"run": {"steps": 1, "device": "cpu", "threads": 1, "checkpoint_every": 0},
                                  "data": {"source": str(prompt_file)}, "rollout": {"max_new_tokens": 6},
                                  "verifier": {"name": "tests.plugins:odd_char_sum"},
                                  "algorithm": {"prompts_per_step": 4, "num_minibatches": 2}, "eval": eval_sec})
    exp = Experiment(conf)
    exp.run()
    run = tmp_path / "exp" / "grpo_n8" / "seed0" / "llama"
    summary_path = run / "summary.json"
    trained = json.loads(summary_path.read_text())
    rows = (run / "eval" / "step_000001.jsonl").read_text()
    assert trained["eval_config"]["seeding"] == "prompt"
    assert exp.reevaluate() == 0  # evaluated as the config says: nothing to do
    # a run whose record says it was scored otherwise is scored again: same settings, same numbers
    stale = dict(trained, eval_config=dict(trained["eval_config"], k=1))
    summary_path.write_text(json.dumps(stale))
    assert exp.reevaluate() == 1
    again = json.loads(summary_path.read_text())
    assert again["eval_after"] == trained["eval_after"] and again["eval_config"] == trained["eval_config"]
    assert (run / "eval" / "step_000001.jsonl").read_text() == rows
    # a larger test split: every finished run is scored on it
    bigger = dataclasses.replace(conf, base={**conf.base, "eval": {**eval_sec, "data": {"source": str(prompt_file),
                                                                                        "max_prompts": 5}}})
    assert Experiment(bigger).reevaluate() == 2
    assert json.loads(summary_path.read_text())["eval_after"]["n_prompts"] == 5
    assert Experiment(bigger).reevaluate() == 0


def test_cli_runs_a_subset_of_arms(tmp_path, monkeypatch, capsys):
    from graft_fed import cli
    from graft_fed import experiment as ex

    cfg = {"output_dir": str(tmp_path / "exp"), "seeds": [0, 1], "models": {"a": "x", "b": "y"},
           "pairs": [["a", "b"]], "arms": ["grpo_n8", "graft", "stored", "no_gate"], "base": {}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ran = []
    monkeypatch.setattr(ex.Experiment, "__init__", lambda self, c, quiet=True: setattr(self, "cfg", c))
    monkeypatch.setattr(ex.Experiment, "run", lambda self: ran.append((self.cfg.seeds, self.cfg.arms)))
    monkeypatch.setattr(ex, "write_report", lambda c: (tmp_path / "r.md", (tmp_path / "r.md").write_text("r"))[0])
    assert cli.main(["experiment", "--config", str(path), "--seeds", "1", "--arms", "no_gate"]) == 0
    # stored learns from the grpo_n8 runs: they come with it (and are skipped where finished)
    assert cli.main(["experiment", "--config", str(path), "--arms", "stored"]) == 0
    assert ran == [((1,), ("no_gate",)), ((0, 1), ("grpo_n8", "stored"))]
    assert cli.main(["experiment", "--config", str(path), "--arms", "pooled"]) == 2
    assert "--arms ['pooled'] are not arms of" in capsys.readouterr().err


def test_issue15_arms_run_and_score_the_final_and_best_validation_checkpoints(tiny_llama, tiny_gpt2, prompt_file,
                                                                             tmp_path):
    """The arms added for issue 15 (random peer, gate off and SFT on peer successes with all
    models, replay) run as settings of the existing machinery, and with test_eval every run's
    final and best-validation checkpoints are scored on the test set, the others pruned."""
    from graft_fed.experiment import ExperimentConfig, run_paths, selection_scores

    ev = {"data": {"source": str(prompt_file), "max_prompts": 3}, "k": 1, "seeding": "prompt"}
    conf = ExperimentConfig(
        output_dir=str(tmp_path / "exp"), seeds=(0,), models={"llama": str(tiny_llama), "gpt2": str(tiny_gpt2)},
        pairs=(("llama", "gpt2"),),
        arms=("grpo_n8", "graft", "stored", "graft_all", "graft_random", "no_gate_all", "sft_peer", "replay"),
        base={"run": {"steps": 4, "device": "cpu", "threads": 1, "eval_every": 2},
              "data": {"source": str(prompt_file)}, "rollout": {"max_new_tokens": 4},
              "verifier": {"name": "tests.plugins:odd_char_sum"},
              "algorithm": {"prompts_per_step": 4, "num_minibatches": 2}, "eval": ev},
        test_eval={**ev, "data": {"source": str(prompt_file), "max_prompts": 5}},
        withheld={"llama": ("x",)}, implausible="gpt2")
    text = Experiment(conf).run().read_text()
    assert "## Withheld slices" in text and "### The claims" in text
    paths = run_paths(conf, conf.arms)
    assert len(paths) == 2 * 8
    for (recv, _, arm), _, path in paths:
        summary = json.loads((path / "summary.json").read_text())
        test = summary["test"]
        assert [r["step"] for r in test["validation"]] == [0, 2, 4]
        assert test["final"]["step"] == 4 and test["best_val"]["step"] in (0, 2, 4)
        kept = sorted(p.name for p in (path / "checkpoints").iterdir() if p.name.startswith("step_"))
        assert kept == sorted({f"step_{s:06d}" for s in (4, test["best_val"]["step"]) if s})
        sc = selection_scores(conf, path, recv)
        assert set(sc) >= {"final/all", "best_val/all", "auc/all"}
    cfg = json.loads((tmp_path / "exp" / "graft_random" / "seed0" / "all" / "llama" / "config.json").read_text())
    assert cfg["graft"]["source_choice"] == "random"
    cfg = json.loads((tmp_path / "exp" / "sft_peer" / "seed0" / "all" / "gpt2" / "config.json").read_text())
    assert cfg["graft"]["transfer"] == "success_only" and cfg["graft"]["gate"] is False
    rows = [json.loads(x) for x in (tmp_path / "exp" / "replay" / "seed0" / "llama" / "metrics.jsonl")
            .read_text().splitlines()]
    assert any("graft/all_fail" in r for r in rows)  # the replay peers ran the GRAFT step
    # scoring is idempotent: a second invocation trains and scores nothing
    before = (paths[0][2] / "summary.json").stat().st_mtime
    Experiment(conf).run()
    assert (paths[0][2] / "summary.json").stat().st_mtime == before


def test_claims_read_paired_differences_on_the_withheld_slice(tmp_path):
    from graft_fed.experiment import ExperimentConfig, claims

    root = tmp_path / "exp"
    conf = ExperimentConfig(output_dir=str(root), seeds=(0, 1), models={"a": "x", "b": "y", "c": "z"},
                            pairs=(("a", "b"), ("a", "c"), ("b", "c")),
                            arms=("grpo_n8", "grpo_n16", "graft", "stored", "graft_all", "graft_random",
                                  "no_gate_all"),
                            withheld={"a": ("lin",), "b": ("mod",), "c": ("mod", "lin")}, implausible="b",
                            base={"run": {"eval_every": 2}}, test_eval={"k": 1})

    def put(path, withheld_score):
        path.mkdir(parents=True)
        ev = {"pass@1": 0.5, "by_group": {"mod": withheld_score, "lin": withheld_score}}
        (path / "summary.json").write_text(json.dumps({"test": {
            "final": {"step": 4, **ev}, "best_val": {"step": 2, **ev},
            "validation": [{"step": 0, "pass@1": 0.1, "by_group": ev["by_group"]}]}}))

    scores = {"grpo_n8": 0.10, "grpo_n16": 0.20, "graft": 0.30, "stored": 0.28, "graft_all": 0.35,
              "graft_random": 0.25, "no_gate_all": 0.20}
    for seed in (0, 1):
        s = f"seed{seed}"
        for m in "abc":
            put(root / "grpo_n8" / s / m, scores["grpo_n8"])
            put(root / "grpo_n16" / s / m, scores["grpo_n16"])
            for arm in ("graft_all", "graft_random", "no_gate_all"):
                put(root / arm / s / "all" / m, scores[arm])
        for a, b in (("a", "b"), ("a", "c"), ("b", "c")):
            put(root / "graft" / s / f"{a}+{b}" / a, scores["graft"])
            put(root / "graft" / s / f"{a}+{b}" / b, scores["graft"])
            put(root / "stored" / s / f"{a}<-{b}", scores["stored"])
            put(root / "stored" / s / f"{b}<-{a}", scores["stored"])
    text = "\n".join(claims(conf))
    assert "beats GRPO n=16 on every receiver's withheld slice: **met**" in text
    assert "Stored keeps >= 85% of the co-trained gain: **met**" in text  # 18 of 20 points: 90%
    assert "Gate-off is worse when the implausible peer (b) is present: **met**" in text
    assert "> random matching: **met**" in text
    assert "a +15.0 ± 0.0 (2/2 seeds ahead): met" in text  # each receiver's own verdict
    # one receiver without the gain: the claim is not met, and the rows say for whom
    for seed in (0, 1):
        (root / "graft_all" / f"seed{seed}" / "all" / "c" / "summary.json").unlink()
        (root / "graft_all" / f"seed{seed}" / "all" / "c").rmdir()
        put(root / "graft_all" / f"seed{seed}" / "all" / "c", 0.15)
    text = "\n".join(claims(conf))
    assert "withheld slice: **not met**" in text
    assert "a +15.0 ± 0.0 (2/2 seeds ahead): met" in text and "c -5.0 ± 0.0 (0/2 seeds ahead): not met" in text
    empty = ExperimentConfig(output_dir=str(tmp_path / "none"), seeds=(0,), models=conf.models, pairs=conf.pairs,
                             arms=conf.arms, withheld=conf.withheld, implausible="b",
                             base=conf.base, test_eval=conf.test_eval)
    assert "**not yet measured**" in "\n".join(claims(empty))


def test_a_withheld_slice_the_test_split_does_not_score_is_refused(tmp_path):
    """A withheld slice missing from test_eval's families would report nothing for the primary
    metric: the config is refused, naming the slice and where to add it."""
    import pytest

    from graft_fed.errors import ConfigError
    from graft_fed.experiment import ExperimentConfig

    ev = {"data": {"source": "embedded:arith-v1", "split": "test", "families": ["add_nocarry", "mul"]}}
    with pytest.raises(ConfigError, match=r"withheld\['qwen3'\] names \['add_carry'\].*add them there"):
        ExperimentConfig(output_dir=str(tmp_path), seeds=(0,), models={"llama": "a", "qwen3": "b"},
                         base={"run": {"eval_every": 2}}, test_eval=ev, withheld={"qwen3": ("add_carry",)})
    ExperimentConfig(output_dir=str(tmp_path), seeds=(0,), models={"llama": "a", "qwen3": "b"},
                     base={"run": {"eval_every": 2}}, test_eval={"data": {**ev["data"], "families": ["add_carry"]}},
                     withheld={"qwen3": ("add_carry",)})

import json
import shutil

import pytest
import torch

from graft_fed.errors import CheckpointError, ConfigError
from graft_fed.trainer.config import load_train_config
from graft_fed.trainer.grpo import GRPOTrainer
from graft_fed.trainer.metrics import read_metrics

TRL_NAMES = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
             "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy"]


def make_cfg(model_dir, prompt_file, out_dir, **over):
    base = {
        "run": {"output_dir": str(out_dir), "steps": 2, "seed": 7, "device": "cpu", "checkpoint_every": 1,
                "threads": 1},
        "model": {"path": str(model_dir), "template": "chat"},
        "data": {"source": str(prompt_file)},
        "rollout": {"n": 4, "max_new_tokens": 6, "batch_size": 16},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 4, "num_minibatches": 2, "micro_batch_size": 8},
        "optim": {"lr": 1e-2},
    }
    for dotted, value in over.items():
        node = base
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = out_dir.parent / f"{out_dir.name}.yaml"
    import yaml
    path.write_text(yaml.safe_dump(base))
    return load_train_config(path)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_step_updates_model_and_logs_trl_metrics(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "run")
    with GRPOTrainer(cfg, quiet=True) as tr:
        before = params(tr.model).clone()
        row = tr.train_step()
        assert not torch.equal(before, params(tr.model))
    for name in TRL_NAMES + ["grad_norm", "time/rollout", "time/verify", "time/train", "frac_all_fail",
                             "frac_all_pass", "tokens_per_second/rollout"]:
        assert name in row, name
    assert 0 < row["reward"] < 1  # the plugin reward gives this random model mixed groups
    # first minibatch has ratio 1 exactly, so only later minibatches can clip
    assert 0.0 <= row["clip_ratio/region_mean"] <= 1.0


def test_exact_resume_matches_uninterrupted_run(tiny_gpt2, prompt_file, tmp_path):
    full = make_cfg(tiny_gpt2, prompt_file, tmp_path / "full", **{"run.steps": 3})
    with GRPOTrainer(full, quiet=True) as tr:
        tr.train(evaluate_before_after=False)
        want = params(tr.model)
    want_rows = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]

    part = make_cfg(tiny_gpt2, prompt_file, tmp_path / "part", **{"run.steps": 1})
    with GRPOTrainer(part, quiet=True) as tr:
        tr.train(evaluate_before_after=False)
    resumed_cfg = make_cfg(tiny_gpt2, prompt_file, tmp_path / "part", **{"run.steps": 3})
    with GRPOTrainer(resumed_cfg, resume="auto", quiet=True) as tr:
        assert tr.step == 1
        tr.train(evaluate_before_after=False)
        got = params(tr.model)
    got_rows = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in got_rows] == [1, 2, 3]
    for key in ["reward", "loss", "grad_norm", "entropy", "completions/mean_length"]:
        assert [r[key] for r in got_rows] == [r[key] for r in want_rows], key
    assert torch.equal(got, want)


def test_micro_batch_size_does_not_change_the_gradients(tiny_llama, prompt_file, tmp_path):
    grads = []
    for mb in (3, 64):
        cfg = make_cfg(tiny_llama, prompt_file, tmp_path / f"mb{mb}", **{"algorithm.micro_batch_size": mb})
        with GRPOTrainer(cfg, quiet=True) as tr:
            seen = []
            # capture each minibatch's accumulated gradient instead of stepping
            tr.optimizer.step = lambda: seen.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
            tr.train_step()
            grads.append(torch.stack(seen))
    assert grads[0].shape[0] == 2 and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_corrupt_and_foreign_checkpoints_are_refused(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"run.steps": 1})
    with GRPOTrainer(cfg, quiet=True) as tr:
        path = tr.save_checkpoint()
    other = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"run.steps": 1, "algorithm.eps_high": 0.3})
    with pytest.raises(CheckpointError, match=r"different configuration.*algorithm\.eps_high: 0\.28 -> 0\.3") as info:
        GRPOTrainer(other, resume=str(path), quiet=True)
    assert "fingerprint" not in str(info.value) and "optim" not in str(info.value)  # only what differs
    # a checkpoint written before manifests recorded the configuration: named from its run's
    # config.json while that still matches, else the fingerprints and why no names
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["config"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"algorithm\.eps_high: 0\.28 -> 0\.3"):
        GRPOTrainer(other, resume=str(path), quiet=True)
    (tmp_path / "run" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"fingerprint \w+ != \w+; the checkpoint does not record"):
        GRPOTrainer(other, resume=str(path), quiet=True)
    weights = next(path.joinpath("model").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        GRPOTrainer(cfg, resume=str(path), quiet=True)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        GRPOTrainer(cfg, resume=str(path), quiet=True)
    shutil.rmtree(path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        GRPOTrainer(cfg, resume=str(path), quiet=True)


def test_config_errors_say_what_and_how(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  prompts_per_stp: 8\n")
    with pytest.raises(ConfigError, match="did you mean 'prompts_per_step'"):
        load_train_config(bad)
    bad.write_text("algorithm:\n  prompts_per_step: 10\n  num_minibatches: 4\n")
    with pytest.raises(ConfigError, match="divisible"):
        load_train_config(bad)
    bad.write_text("optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match="optim.lr"):
        load_train_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_train_config(bad)
    assert load_train_config(None, {"optim.lr": "1e-6"}).optim.lr == 1e-6


def test_kl_entropy_and_dynamic_sampling_options(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "opts", **{
        "algorithm.kl_coef": 0.1, "algorithm.entropy_coef": 0.01, "algorithm.dynamic_sampling.enabled": True,
        "algorithm.dynamic_sampling.max_extra_batches": 2, "optim.schedule": "cosine", "optim.warmup_steps": 1})
    with GRPOTrainer(cfg, quiet=True) as tr:
        assert tr.ref_model is not None
        row = tr.train_step()
    assert row["kl"] >= 0.0 and "entropy" in row
    # dynamic sampling trained only on groups with reward variance
    assert row["dynamic_sampling/kept_groups"] <= 4
    assert row["learning_rate"] == pytest.approx(1e-2)  # end of the 1-step warm-up


def test_lr_schedules():
    from graft_fed.trainer.grpo import lr_lambda

    assert [lr_lambda("constant", 2, 10, 0.0)(s) for s in (0, 1, 5)] == [0.5, 1.0, 1.0]
    lin = lr_lambda("linear", 0, 10, 0.1)
    assert lin(0) == 1.0 and lin(10) == pytest.approx(0.1)
    cos = lr_lambda("cosine", 0, 10, 0.0)
    assert cos(0) == 1.0 and cos(5) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0, abs=1e-12)


def test_truncated_responses_can_be_masked(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "mask", **{"algorithm.mask_truncated": True,
                                                                    "rollout.max_new_tokens": 2})
    with GRPOTrainer(cfg, quiet=True) as tr:
        data = tr.collect()
        flat = tr._flatten(data.groups)
        truncated = [c.finish_reason == "length" for g in data.groups for c in g.completions]
        assert any(truncated)
        assert flat["keep"].tolist() == [0.0 if t else 1.0 for t in truncated]


def test_a_minibatch_with_every_response_gated_out_takes_no_optimiser_step(tiny_llama, prompt_file, tmp_path):
    """Its gradient is zero, but AdamW would still move the weights (momentum, weight decay):
    the step is skipped and counted."""
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "r", **{"optim.weight_decay": 0.1})
    with GRPOTrainer(cfg, quiet=True) as tr:
        groups = tr.collect().groups
        before = params(tr.model).clone()
        for g in groups:  # as if every response were a peer's the gate dropped (Eq. 8: w = 0)
            g.weights = torch.zeros(g.n)
        m = tr.optimise(groups)
        assert m["skipped_minibatches"] == m["num_minibatches"] == 2
        assert torch.equal(params(tr.model), before)
        for g in groups[2:]:  # the second minibatch keeps its responses again
            g.weights = None
        m = tr.optimise(groups)
        assert m["skipped_minibatches"] == 1 and not torch.equal(params(tr.model), before)


def test_rollout_sampling_fields_are_validated_by_sampling_params_alone(tmp_path):
    from graft_fed.rollout.base import SamplingParams
    from graft_fed.trainer.config import RolloutSection

    for field, value in (("temperature", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_new_tokens", 0)):
        with pytest.raises(ConfigError) as section_err:
            RolloutSection(**{field: value})
        with pytest.raises(ConfigError) as params_err:
            SamplingParams(**{field: value})
        assert str(section_err.value) == f"rollout.{params_err.value}"
    with pytest.warns(UserWarning, match="truncated distribution"):
        section = RolloutSection(temperature=0.7, top_k=5)
    assert section.sampling_params() == SamplingParams(n=8, temperature=0.7, top_k=5, max_new_tokens=160)


def test_a_non_finite_update_is_skipped_counted_and_its_peer_groups_named(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "r")
    with GRPOTrainer(cfg, quiet=True) as tr:
        groups = tr.collect().groups
        before = params(tr.model).clone()
        # whatever got past screening: an infinite advantage in a peer group of the last minibatch
        groups[-1].source = "mallory"
        groups[-1].advantages = torch.full((groups[-1].n,), float("inf"))
        m = tr.optimise(groups)
        assert m["skipped_nonfinite"] == 1 and tr.nonfinite_groups == [("mallory", groups[-1].prompt.id)]
        after = params(tr.model)
        assert torch.isfinite(after).all() and not torch.equal(after, before)  # the first minibatch trained


def test_a_fresh_run_into_a_used_output_dir_is_refused_before_writing(tiny_llama, prompt_file, tmp_path):
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"run.steps": 1})
    with GRPOTrainer(cfg, quiet=True) as tr:
        tr.train(evaluate_before_after=False)
    run = tmp_path / "run"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = make_cfg(tiny_llama, prompt_file, run, **{"run.steps": 2})
    with pytest.raises(CheckpointError, match=r"already holds another run \(checkpoints step_000001; "
                                              r"metrics.jsonl with 1 row; summary.json\): resume it with --resume"):
        GRPOTrainer(again, quiet=True)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    # resuming it is what that folder is for
    with GRPOTrainer(again, resume="auto", quiet=True) as tr:
        assert tr.step == 1
    # a folder a run only started in (no step, no checkpoint) may be started afresh
    fresh = make_cfg(tiny_llama, prompt_file, tmp_path / "started", **{"run.steps": 1})
    GRPOTrainer(fresh, quiet=True).close()
    GRPOTrainer(fresh, quiet=True).close()
    # --resume where a run crashed before its first checkpoint: it starts over with a fresh log
    (tmp_path / "started" / "metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.5}\n')
    with GRPOTrainer(fresh, resume="auto", quiet=True) as tr:
        assert tr.step == 0
    assert (tmp_path / "started" / "metrics.jsonl").read_text() == ""
    # the rows taken out are kept beside it
    assert (tmp_path / "started" / "metrics.dropped.jsonl").read_text() == '{"step": 0, "eval/pass@1": 0.5}\n'


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(tiny_llama, prompt_file, tmp_path):
    from graft_fed.trainer import checkpoint as ckpt

    run = tmp_path / "run"
    cfg = make_cfg(tiny_llama, prompt_file, run, **{"run.steps": 2, "run.keep_checkpoints": 5})
    with GRPOTrainer(cfg, quiet=True) as tr:
        tr.train(evaluate_before_after=False)
    root = run / "checkpoints"
    old_two = (root / "step_000002" / "trainer_state.pt").read_bytes()
    old_rows = (run / "metrics.jsonl").read_text().splitlines()
    # resumed from step 1: step 2 of the first line is abandoned, and kept where no resume sees it
    with GRPOTrainer(cfg, resume=str(root / "step_000001"), quiet=True) as tr:
        assert tr.step == 1
        assert [p.name for p in ckpt.checkpoint_dirs(root)] == ["step_000001"]
        (aside,) = list((root / "abandoned").iterdir())
        assert (aside / "step_000002" / "trainer_state.pt").read_bytes() == old_two
        assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1]
        assert (run / "metrics.dropped.jsonl").read_text().splitlines() == old_rows[1:]
        # a crash here: a bare --resume continues from step 1, not the abandoned step 2
        assert ckpt.latest_checkpoint(root) == root / "step_000001"
        tr.train(evaluate_before_after=False)
    assert [p.name for p in ckpt.checkpoint_dirs(root)] == ["step_000001", "step_000002"]
    assert (root / "step_000002" / "trainer_state.pt").read_bytes() != old_two
    assert (aside / "step_000002").is_dir()
    # set_aside_after on its own: later steps only, a second call beside the first
    for step in (3, 4):
        (root / f"step_{step:06d}").mkdir()
    assert [p.name for p in ckpt.set_aside_after(root, 2)] == ["step_000003", "step_000004"]
    assert len(list((root / "abandoned").iterdir())) == 2 and ckpt.set_aside_after(root, 2) == []


def test_a_second_run_into_a_folder_another_run_is_using_is_refused(tiny_llama, prompt_file, tmp_path):
    """Two runs started into one empty folder at once (two nodes given one output_dir, or a
    node started again while it runs) both passed the check above: their checkpoints
    replaced each other's and their metrics interleaved. The folder is locked while a run
    lives, with or without --resume."""
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"run.steps": 1})
    first = GRPOTrainer(cfg, quiet=True)
    try:
        other = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"run.steps": 1, "run.seed": 8})
        for resume in (None, "auto"):
            with pytest.raises(CheckpointError, match=r"run.output_dir .*run is in use by another run that is still "
                                                      r"running.*its own run.output_dir"):
                GRPOTrainer(other, resume=resume, quiet=True)
        first.train(evaluate_before_after=False)
    finally:
        first.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == [1]  # the first run's rows alone
    with GRPOTrainer(cfg, resume="auto", quiet=True) as tr:  # closed: the folder is free again
        assert tr.step == 1


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    from graft_fed.trainer import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for step in (30, 40):
        (root / f"step_{step:06d}").mkdir(parents=True)
    for step, keep, left in ((2, 2, [2, 40]), (3, 1, [3]), (5, 3, [3, 5])):
        tmp = root / f".tmp_{step}"
        tmp.mkdir()
        final = ckpt.commit(tmp, root, step, keep)
        assert final.is_dir() and final.name == f"step_{step:06d}"
        assert sorted(int(p.name[5:]) for p in ckpt.checkpoint_dirs(root)) == left

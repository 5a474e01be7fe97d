"""The CLI end to end on tiny local models (no network): train, resume, eval on a benchmark
file, score, plot, store, and clear errors for bad input."""

import json
from pathlib import Path

import yaml

from graft_fed.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


def _train_cfg(tmp_path, model, prompt_file, steps=2):
    cfg = {"run": {"output_dir": str(tmp_path / "run"), "steps": steps, "device": "cpu", "threads": 1,
                   "checkpoint_every": 1},
           "model": {"path": str(model)}, "data": {"source": str(prompt_file)},
           "rollout": {"n": 2, "max_new_tokens": 4}, "verifier": {"name": "tests.plugins:odd_char_sum"},
           "algorithm": {"prompts_per_step": 4, "num_minibatches": 2},
           "eval": {"data": {"source": str(prompt_file), "max_prompts": 2}, "k": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_resume_plot_store(tiny_llama, prompt_file, tmp_path, capsys):
    cfg = _train_cfg(tmp_path, tiny_llama, prompt_file)
    assert main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "held-out pass@1" in out and "before" in out
    assert main(["train", "--config", str(cfg), "--quiet", "--resume", "--set", "run.steps=3", "--no-eval"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "plots" / "learning_curves.png").stat().st_size > 1000
    store = tmp_path / "run" / "trajectories.sqlite"
    assert main(["store", "export", str(store), str(tmp_path / "groups.jsonl")]) == 0
    assert len((tmp_path / "groups.jsonl").read_text().splitlines()) == 3 * 4
    assert main(["store", "import", str(tmp_path / "groups.jsonl"), str(tmp_path / "copy.sqlite")]) == 0


def test_eval_on_a_benchmark_file_by_name(tiny_llama, tmp_path, capsys):
    rc = main(["eval", "--model", str(tiny_llama), "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES),
               "-k", "2", "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "ev")])
    assert rc == 0
    summary = json.loads((tmp_path / "ev" / "math500.summary.json").read_text())
    assert summary["k"] == 2 and summary["n_prompts"] == 3 and 0.0 <= summary["pass@1"] <= 1.0
    rows = (tmp_path / "ev" / "math500.jsonl").read_text().splitlines()
    assert len(rows) == 3 and len(json.loads(rows[0])["responses"]) == 2


def test_score_command(tmp_path, capsys):
    (tmp_path / "r.jsonl").write_text('{"id": "a", "response": "so \\\\boxed{4}"}\n{"id": "b", "response": "5"}\n')
    (tmp_path / "g.jsonl").write_text('{"id": "a", "answer": "4"}\n{"id": "b", "answer": "5"}\n')
    assert main(["score", "--responses", str(tmp_path / "r.jsonl"), "--references", str(tmp_path / "g.jsonl"),
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    scored = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [s["reward"] for s in scored] == [1.0, 0.0]  # "5" has no boxed answer


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  stepz: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'run.stepz'" in err and "did you mean 'steps'" in err
    assert main(["train", "--set", "run.steps"]) == 2
    assert "expected section.key=value" in capsys.readouterr().err
    assert main(["eval", "--model", "zoo:nope", "--benchmark", "math500"]) == 2
    assert "GRAFT_FED_BENCHMARKS_DIR" in capsys.readouterr().err  # says how to point at the files
    assert main(["eval", "--model", "zoo:nope", "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES)]) == 2
    assert "unknown zoo model" in capsys.readouterr().err

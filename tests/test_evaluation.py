"""Held-out evaluation: keyed ("prompt") seeding makes a prompt's samples depend on the
evaluation seed and the prompt id alone, so arms are scored on common random numbers."""

from __future__ import annotations

import pytest

from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.evaluation import evaluate
from graft_fed.modeling import load_model_and_tokenizer
from graft_fed.rewards import VerifierConfig, build_verifier
from graft_fed.trainer.config import EvalSection
from graft_fed.errors import ConfigError


@pytest.fixture(scope="module")
def setup(tiny_llama):
    model, tok = load_model_and_tokenizer(str(tiny_llama), "cpu")
    prompts = load_prompts(DataConfig(source="embedded:arith-v1", split="test", max_prompts=10))
    with build_verifier(VerifierConfig(name="tests.plugins:odd_char_sum", workers=1)) as verifier:
        yield model, tok, prompts, verifier


def _run(setup, prompts=None, **kw):
    model, tok, all_prompts, verifier = setup
    args = dict(template="chat", add_special_tokens=False, k=3, temperature=1.0, top_p=1.0,
                max_new_tokens=12, seed=7, batch_size=64)
    args.update(kw)
    result = evaluate(model, tok, prompts if prompts is not None else all_prompts, verifier, **args)
    return {row["id"]: row["responses"] for row in result.rows}


def test_prompt_seeding_ignores_batch_size_and_order(setup):
    prompts = setup[2]
    ref = _run(setup, seeding="prompt")
    assert _run(setup, seeding="prompt", batch_size=5) == ref
    assert _run(setup, prompts=list(reversed(prompts)), seeding="prompt") == ref
    # one prompt alone draws the same samples as inside the whole set
    one = _run(setup, prompts=[prompts[3]], seeding="prompt")
    assert one[prompts[3].id] == ref[prompts[3].id]


def test_prompt_seeding_depends_on_the_seed(setup):
    a = _run(setup, seeding="prompt", seed=7)
    b = _run(setup, seeding="prompt", seed=8)
    assert a != b
    # the stream sampler is a different draw (its samples depend on the batch they are in)
    assert _run(setup, seeding="stream", batch_size=5) != _run(setup, seeding="stream", batch_size=64)


def test_unknown_seeding_is_refused(setup):
    with pytest.raises(ValueError, match="seeding"):
        _run(setup, seeding="per-prompt")
    with pytest.raises(ConfigError, match="eval.seeding"):
        EvalSection(seeding="per-prompt")


def test_a_local_model_is_the_folder_it_resolves_to_however_it_was_written(tmp_path):
    import json

    from graft_fed.evaluation import eval_conflict

    path = tmp_path / "bench.summary.json"
    mine = {"model": "runs/x/model", "model_path": "/abs/runs/x/model", "benchmark": "embedded:arith-v1",
            "benchmark_path": None, "k": 4}
    path.write_text(json.dumps({"settings": mine}))
    assert eval_conflict(path, {**mine, "model": "../main/runs/x/model"}) == ""  # the same folder
    assert "model_path" in eval_conflict(path, {**mine, "model_path": "/abs/other"})
    assert 'model: "runs/x/model" -> "zoo:tiny"' in eval_conflict(path, {**mine, "model": "zoo:tiny",
                                                                          "model_path": None})

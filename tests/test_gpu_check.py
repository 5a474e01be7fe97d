"""bench/gpu_check.py's logic on CPU (--tiny), so the GPU check cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # the reward plugin is named gpu_check:complementary_reward
    spec.loader.exec_module(module)
    return module


def test_tiny_gpu_check_runs_a_graft_step_and_reports(tmp_path):
    gc = _load()
    result = gc.main(["--tiny", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["runs"][0]["backend"] == "hf"
    hf, vllm = result["runs"]
    assert vllm == {"backend": "vllm", "skipped": "needs a CUDA device"}
    assert set(hf["members"]) == {"qwen3-1.7b", "llama-3.2-1b"}
    for m in hf["members"].values():
        # 8 prompts x n=4 responses x 8 tokens: a random model never stops early
        assert m["rollout_tokens"] == 8 * 4 * 8 and m["mean_response_tokens"] == 8
        assert m["train_tokens"] > m["rollout_tokens"]  # prompts + responses (own and peer)
        assert m["peer_groups_received"] > 0  # the GRAFT exchange ran in both directions
        for key in ("rollout_mfu", "train_mfu", "rollout_tokens_per_s", "train_tokens_per_s"):
            assert math.isfinite(m[key]) and m[key] > 0, key
        assert math.isclose(m["train_tflops"], 6 * m["params"] * m["train_tokens"] / m["train_s"] / 1e12)
        assert math.isclose(m["train_mfu"], m["train_tflops"] / result["matmul"]["tflops"])
    assert result["matmul"]["tflops"] > 0 and result["hardware"]["device"] == "cpu"


def test_full_configs_are_the_real_architectures(tmp_path):
    gc = _load()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    counts = {}
    for name in gc.ARCHS:
        spec = gc.arch_config(name, tiny=False)
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == {"qwen3-1.7b": 1_720_574_976, "llama-3.2-1b": 1_235_814_400}


def test_synthetic_tokenizer_has_the_model_vocabulary_and_encodes_prompts(tmp_path):
    gc = _load()
    words = gc.prompt_words()
    tok = gc.build_tokenizer(tmp_path, 700, "q", words)
    assert len(tok) == 700 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    ids = tok("What is 12 + 7?\nPlease reason step by step, and put your final answer within \\boxed{}.")["input_ids"]
    assert tok.unk_token_id not in ids and ids[1:4] == tok.convert_tokens_to_ids(["is", "1", "2"])
    assert gc.complementary_reward("q5 q9", "4") in (0.0, 1.0) and gc.complementary_reward("l5 q9", "4") == 0.0
    assert gc.complementary_reward("q5 q9", "3") == 0.0


def test_memory_plan_prints_the_scaling_tables(capsys):
    spec = importlib.util.spec_from_file_location("memory_plan", ROOT / "bench" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_plan"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    out = capsys.readouterr().out
    # 16 bytes per parameter of trainer state: 1.72 B -> 27.5 GB; 3.08 B -> 49.2 GB
    assert "| Qwen3-1.7B-Base | 1.72 B | 27.5 GB |" in out and "| SmolLM3-3B-Base | 3.08 B | 49.2 GB |" in out
    assert "| OctoThinker-3B-Hybrid-Base | 3.21 B | 51.4 GB |" in out
    # docs/scaling.md quotes these tables: they must still be what the script prints
    doc = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert out.strip() in doc


def test_tiny_gpu_check_says_which_vllm_checks_did_not_run(tmp_path, capsys):
    gc = _load()
    result = gc.main(["--tiny", "--out", str(tmp_path)])
    checks = result["vllm_checks"]
    # no GPU here (and no vllm in CI): every check is listed as not run, with the reason
    assert checks["not_run"] == list(gc.VLLM_CHECKS) and len(gc.VLLM_CHECKS) == 7
    assert "vllm" in checks["skipped"] or "CUDA" in checks["skipped"]
    assert f"vLLM checks NOT RUN ({checks['skipped']})" in capsys.readouterr().out


def _fake_vllm(monkeypatch, llm_cls):
    from tests.rollout.test_vllm_backend import fake_vllm_module

    from graft_fed.rollout import vllm as vb

    monkeypatch.setattr(vb, "import_vllm", lambda: fake_vllm_module(llm_cls))
    monkeypatch.setattr(vb, "require_cuda", lambda device=None: None)


def test_vllm_checks_pass_on_a_correct_engine(monkeypatch):
    """The checks' own logic, on CPU against the test suite's fake vLLM engine."""
    import torch
    from tests.rollout.test_vllm_backend import FakeLLM

    gc = _load()
    _fake_vllm(monkeypatch, FakeLLM)
    checks = gc.vllm_checks(torch.device("cpu"), log=lambda msg: None)
    assert checks["engine_path"] == {"ok": True, "path": "local"}
    for name in gc.VLLM_CHECKS[1:-1]:
        assert checks[name]["ok"] is True, (name, checks[name])
    assert checks["memory_handover"] == {"ok": None, "skipped": "needs a CUDA device"}
    assert checks["finish_reasons_at_cap"]["length"] > 0  # the cap was reached, so the rule was exercised
    assert "NOT OK" not in gc.vllm_checks_table(checks)


def test_vllm_checks_catch_raw_logprobs_and_a_wrong_finish_reason(monkeypatch):
    import torch
    from tests.rollout.test_vllm_backend import FakeLLM

    from graft_fed.rollout import vllm as vb

    class Broken(FakeLLM):
        """Ignores logprobs_mode (always raw), and reports an EOS sampled as the last allowed
        token as "length", as vLLM 0.10.2 does (here every response ends so)."""

        def __init__(self, **kwargs):
            super().__init__(**{**kwargs, "logprobs_mode": "raw_logprobs"}, length_before_stop=True,
                             eos_on_last_step=True)

    gc = _load()
    _fake_vllm(monkeypatch, Broken)
    # and a backend that trusts the engine's finish reason (the old one did)
    monkeypatch.setattr(vb, "finish_reason", lambda reason, ids, stops: reason)
    checks = gc.vllm_checks(torch.device("cpu"), log=lambda msg: None)
    assert checks["finish_reasons_at_cap"]["vllm_reports_for_eos_at_cap"] == ["length"]
    assert checks["processed_logprobs_t0.7"]["ok"] is False
    assert checks["finish_reasons_at_cap"]["ok"] is False and checks["finish_reasons_at_cap"]["errors"]
    assert checks["logprobs_vs_teacher_forced"]["ok"] is True  # at temperature 1 raw is right
    assert "| processed_logprobs_t0.7 | NOT OK |" in gc.vllm_checks_table(checks)

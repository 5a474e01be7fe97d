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

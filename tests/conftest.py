"""Shared fixtures: tiny randomly initialised models with a character tokenizer, built
locally (never downloaded) so unit tests do not depend on the shipped zoo weights."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Nothing in the suite may reach a model hub: a hub id that is not cached fails at once
# instead of waiting on a network that CI may not have.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

CHARS = list("0123456789+-*/=()[]{}\\., :?xXQAabcdefghijklmnopqrstuvwxyzT\n")


def build_char_tokenizer(out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
    fast.save_pretrained(out_dir)


def build_tiny_model(out_dir: Path, arch: str, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(seed)
    vocab = len(tok)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.save_pretrained(out_dir)
    (out_dir / "built_by_test.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), "gpt2")


@pytest.fixture()
def prompt_file(tmp_path) -> Path:
    """Twelve tiny prompts as a JSONL file {problem, answer}."""
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as fh:
        for i in range(12):
            fh.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    return path


def pytest_unconfigure(config):
    """The run is over: the interpreter now joins what tests left behind (executor threads,
    child processes). Should one of them never end, print every thread's stack and exit 1
    after GRAFT_FED_TEST_EXIT_GRACE_S (120 s) instead of hanging until CI's own limit, which
    says nothing about where."""
    grace = float(os.environ.get("GRAFT_FED_TEST_EXIT_GRACE_S", "120"))
    faulthandler.dump_traceback_later(grace, exit=True, file=sys.__stderr__)

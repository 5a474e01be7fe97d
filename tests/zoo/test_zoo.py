import argparse
import json
import random

import pytest
import torch

from graft_fed.data.task import FAMILIES, make_prompt, solution
from graft_fed.data.templates import render_prompt
from graft_fed.errors import ConfigError
from graft_fed.zoo import ZOO_NAMES, resolve_model_path, zoo_dir

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def loaded():
    out = {}
    for name in ZOO_NAMES:
        path = resolve_model_path(f"zoo:{name}")
        tok = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        out[name] = (tok, model, json.loads((zoo_dir() / name / "zoo_card.json").read_text()))
    return out


def test_resolve_model_path():
    assert resolve_model_path("zoo:tiny-llama-char") == str(zoo_dir() / "tiny-llama-char")
    assert resolve_model_path("/some/dir") == "/some/dir"
    with pytest.raises(ConfigError, match="tiny-gpt2-bpe"):
        resolve_model_path("zoo:tiny-nothing")
    with pytest.raises(ConfigError):
        resolve_model_path("")


def test_at_least_three_models_shipped():
    assert len(ZOO_NAMES) >= 3
    for name in ZOO_NAMES:
        d = zoo_dir() / name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "zoo_card.json"):
            assert (d / f).is_file(), f"{name} lacks {f}"


def test_total_size_limit():
    total = sum(f.stat().st_size for f in zoo_dir().rglob("*") if f.is_file())
    assert total < 20e6, f"the zoo weighs {total / 1e6:.1f} MB"


def test_models_differ(loaded):
    types = {m.config.model_type for _, m, _ in loaded.values()}
    assert len(types) == len(ZOO_NAMES)
    params = {sum(p.numel() for p in m.parameters()) for _, m, _ in loaded.values()}
    assert len(params) == len(ZOO_NAMES)
    templates = {t.chat_template for t, _, _ in loaded.values()}
    assert len(templates) == len(ZOO_NAMES)
    vocabs = {len(t) for t, _, _ in loaded.values()}
    assert len(vocabs) == len(ZOO_NAMES)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_tokenizer_round_trip_and_template(loaded, name):
    tok, model, card = loaded[name]
    assert len(tok) < 600 and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.vocab_size >= len(tok)
    rng = random.Random(0)
    for fam in FAMILIES:
        for _ in range(20):
            p = make_prompt(fam, rng)
            for text in (solution(p), p.problem):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert tok.unk_token_id not in ids
                assert tok.decode(ids, skip_special_tokens=True) == text
            ids = tok(solution(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert tok.decode(ids, skip_special_tokens=True) == solution(p)
            assert len(ids) <= card["max_new_tokens"] + 8
    prompt = render_prompt("What is 482 + 379?", "chat", tok)
    assert "What is 482 + 379?" in prompt and prompt == card["example_prompt"]
    assert not prompt.endswith("379?")


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_forward_pass(loaded, name):
    tok, model, _ = loaded[name]
    ids = tok(render_prompt("Compute 731 - 258.", "chat", tok), return_tensors="pt",
              add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()


def test_cards(loaded):
    for name, (_, model, card) in loaded.items():
        assert card["name"] == name
        assert card["params"] == sum(p.numel() for p in model.parameters())
        assert card["tokenizer"]["kind"] in ("char", "bpe", "unigram")
        assert set(card["sft"]["mix"]) <= set(FAMILIES)
        assert "accuracy" in card["measured"]


def test_cli_parses():
    from graft_fed.zoo.cli import add_zoo_subparser

    parser = argparse.ArgumentParser()
    add_zoo_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["zoo", "build", "--out", "x", "--seed", "3", "--only", "tiny-gpt2-bpe"])
    assert (args.out, args.seed, args.only) == ("x", 3, ["tiny-gpt2-bpe"]) and callable(args.func)
    args = parser.parse_args(["zoo", "measure", "--per-family", "4"])
    assert args.per_family == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["zoo", "build", "--only", "nope"])


def test_boxed_scoring():
    from graft_fed.zoo.measure import score

    assert score("1+1=2\nThe answer is \\boxed{861}.", "861") == 1
    assert score("\\boxed{1} then \\boxed{861}", "861") == 1
    assert score("The answer is \\boxed{86}.", "861") == 0
    assert score("no box", "861") == 0


def test_recipes_differ_only_in_the_family_mix_and_never_overwrite_the_shipped_zoo(tmp_path):
    import dataclasses

    from graft_fed.errors import ConfigError
    from graft_fed.zoo.build import RECIPES, SPECS, build_zoo
    from graft_fed.zoo.cli import add_zoo_subparser

    assert RECIPES["default"] is SPECS
    for name, spec in RECIPES["learnable"].items():
        assert dataclasses.replace(spec, mix=SPECS[name].mix) == SPECS[name]
        assert spec.mix != SPECS[name].mix and abs(sum(spec.mix.values()) - 1.0) < 1e-9
    with pytest.raises(ConfigError, match="overwrite the shipped zoo"):
        build_zoo(None, recipe="learnable")
    with pytest.raises(ConfigError, match="unknown zoo recipe"):
        build_zoo(tmp_path, recipe="nope")
    parser = argparse.ArgumentParser()
    add_zoo_subparser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["zoo", "build", "--recipe", "learnable", "--out", "x"]).recipe == "learnable"


def test_complementary_recipe_withholds_one_skill_per_model_and_gives_gpt2_a_second_style():
    """Issue 15: llama knows mod, not lin; gpt2 lin, not mod; qwen3 neither (absent from their
    SFT data); gpt2 writes all its scratchpads in the `words` style; nothing else of the
    shipped specs changes but llama's SFT length."""
    import dataclasses

    from graft_fed.zoo.build import RECIPES, SPECS

    rec = RECIPES["complementary"]
    for name, spec in rec.items():
        same = dataclasses.replace(spec, mix=SPECS[name].mix, styles=SPECS[name].styles, steps=SPECS[name].steps)
        assert same == SPECS[name]
        assert abs(sum(spec.mix.values()) - 1.0) < 1e-9
    mix = {n: s.mix for n, s in rec.items()}
    assert mix["tiny-llama-char"].get("mod", 0) > 0.2 and mix["tiny-llama-char"].get("lin", 0) == 0
    assert mix["tiny-gpt2-bpe"].get("lin", 0) > 0.2 and mix["tiny-gpt2-bpe"].get("mod", 0) == 0
    assert mix["tiny-qwen3-unigram"].get("mod", 0) == 0 and mix["tiny-qwen3-unigram"].get("lin", 0) == 0
    assert dict(rec["tiny-gpt2-bpe"].styles) == {"words": 1.0}
    assert all(dict(s.styles) == {"plain": 1.0} for n, s in rec.items() if n != "tiny-gpt2-bpe")


def test_style_of_is_deterministic_and_follows_the_shares():
    from graft_fed.zoo.build import style_of

    draws = [style_of(f"p{i}", {"plain": 0.5, "words": 0.5}, 0) for i in range(2000)]
    assert draws == [style_of(f"p{i}", {"plain": 0.5, "words": 0.5}, 0) for i in range(2000)]
    assert 900 < draws.count("words") < 1100
    assert {style_of(f"p{i}", {"plain": 1.0}, 0) for i in range(50)} == {"plain"}


def test_the_default_tokenizer_corpus_is_unchanged_by_styles():
    from graft_fed.data.task import FAMILIES, embedded_split, solution
    from graft_fed.zoo.build import tokenizer_corpus

    corpus = tokenizer_corpus(0)
    rows = embedded_split("train", FAMILIES, per_family=1000, seed=0)
    assert corpus == [r.problem for r in rows] + [r.meta["solution"] for r in rows]
    both = tokenizer_corpus(0, ("plain", "words"))
    assert both[:len(corpus)] == corpus and both[len(corpus):] == [solution(r, "words") for r in rows]

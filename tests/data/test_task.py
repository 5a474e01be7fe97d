import random
import re

import pytest

from graft_fed.data.prompts import Prompt, stable_prompt_id
from graft_fed.data.task import (DATASET_ID, FAMILIES, embedded_split, make_prompt, solution,
                                 split_of)
from graft_fed.errors import DataError

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _check_arithmetic(p: Prompt, text: str) -> None:
    """Every scratchpad line is itself correct arithmetic."""
    fam = p.meta["family"]
    for line in text.split("\n")[:-1]:
        if fam in ("add", "sub", "mul"):
            if line.startswith("c"):
                continue
            lhs, rest = line.split("=")
            value = int(rest.split(" ")[0])
            assert eval(lhs) == value, line
        elif fam == "mod":
            lhs, rem = line.split("=")
            n, d = lhs.split("%")
            assert int(n) % int(d) == int(rem), line
        elif fam == "lin":
            parts = line.split("=")
            assert eval(parts[1]) == int(parts[2]), line


def test_families_and_id():
    assert DATASET_ID == "embedded:arith-v1"
    assert set(FAMILIES) >= {"add", "sub", "mul", "mod", "lin"}


@pytest.mark.parametrize("family", FAMILIES)
def test_solutions_are_correct(family):
    rng = random.Random(7)
    for _ in range(300):
        p = make_prompt(family, rng)
        assert p.meta["family"] == family and p.dataset == DATASET_ID
        text = solution(p)
        assert BOXED.findall(text)[-1] == p.answer
        assert text.endswith(f"The answer is \\boxed{{{p.answer}}}.")
        ops = p.meta["operands"]
        truth = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                 "mod": lambda a, b: a % b, "lin": lambda a, b, c: (c - b) // a}[family](*ops)
        assert int(p.answer) == truth
        if family == "lin":
            assert ops[0] * truth + ops[1] == ops[2]
        _check_arithmetic(p, text)
        if family in ("add", "sub"):
            assert len(text) < 120


@pytest.mark.parametrize("family", FAMILIES)
def test_solution_rederived_from_text_alone(family):
    p = make_prompt(family, random.Random(3))
    bare = Prompt(id=p.id, problem=p.problem, answer=p.answer, dataset=p.dataset, meta={})
    assert solution(bare) == solution(p)


def test_deterministic_and_stable_ids():
    a = embedded_split("validation", per_family=20, seed=5)
    b = embedded_split("validation", per_family=20, seed=5)
    assert [(p.id, p.problem, p.answer) for p in a] == [(p.id, p.problem, p.answer) for p in b]
    for p in a:
        assert p.id == stable_prompt_id(DATASET_ID, p.problem)
    assert [p.id for p in embedded_split("validation", per_family=20, seed=6)] != [p.id for p in a]


def test_default_sizes_and_family_coverage():
    test = embedded_split("test")
    assert len(test) == 200 * len(FAMILIES)
    assert {p.meta["family"] for p in test} == set(FAMILIES)
    assert len(embedded_split("validation", families=["add"])) == 100


def test_splits_disjoint_and_deduplicated():
    splits = {s: embedded_split(s, per_family=n, seed=0)
              for s, n in (("train", 600), ("validation", 100), ("test", 200))}
    keys = {}
    for s, rows in splits.items():
        ids = [p.id for p in rows]
        assert len(set(ids)) == len(ids)
        ks = [(p.meta["family"], tuple(p.meta["operands"])) for p in rows]
        assert len(set(ks)) == len(ks)
        keys[s] = set(ks)
        assert all(split_of(p) == s for p in rows)
    assert not keys["train"] & keys["test"]
    assert not keys["train"] & keys["validation"]
    assert not keys["validation"] & keys["test"]
    # membership does not depend on the seed
    other = {(p.meta["family"], tuple(p.meta["operands"])) for p in embedded_split("test", per_family=200, seed=9)}
    assert not other & keys["train"]


def test_errors():
    with pytest.raises(DataError, match="choose from"):
        embedded_split("dev")
    with pytest.raises(DataError, match="add"):
        embedded_split("test", families=["division"])
    with pytest.raises(DataError):
        make_prompt("nope", random.Random(0))
    with pytest.raises(DataError, match="too small"):
        embedded_split("validation", families=["lin"], per_family=1000)
    with pytest.raises(DataError, match="not an embedded"):
        solution(Prompt.make("x", "What is love?", "1"))

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


# --- sub-families (issue 15, setting E) -------------------------------------------------

from graft_fed.data.task import VARIANTS, base_family, family_of  # noqa: E402


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sub_families_are_slices_of_their_family(variant):
    """A sub-family's problems are its family's problems (same text, answer, scratchpad, split
    and prompt id) restricted to its operands, labelled with its own name."""
    base, member = VARIANTS[variant]
    assert base_family(variant) == base and base_family(base) == base
    for split in ("train", "test"):
        rows = embedded_split(split, [variant], per_family=60, seed=3)
        assert len({r.id for r in rows}) == 60
        for r in rows:
            ops = tuple(r.meta["operands"])
            assert member(ops) and r.meta["family"] == variant and family_of(r) == variant
            assert split_of(r) == split
            plain = Prompt.make(DATASET_ID, r.problem, r.answer)  # no meta: read from the text
            assert plain.id == r.id and family_of(plain) == base
            assert solution(plain) == solution(r) == r.meta["solution"]
            assert r.answer == BOXED.findall(r.meta["solution"])[-1]
            _check_arithmetic(Prompt.make(DATASET_ID, r.problem, r.answer, family=base, operands=list(ops)),
                              r.meta["solution"])


def test_sub_families_partition_their_family():
    """Each pair of sub-families splits its family's operands in two, by the scratchpad step
    that names them: a carry-out line for add_carry, a +10 line for sub_borrow."""
    add = embedded_split("test", ["add"], per_family=200)
    carry = [r for r in add if VARIANTS["add_carry"][1](tuple(r.meta["operands"]))]
    assert all(("\nc1 r1" in r.meta["solution"]) == (r in carry) for r in add)
    assert all(VARIANTS["add_carry"][1](tuple(r.meta["operands"]))
               != VARIANTS["add_nocarry"][1](tuple(r.meta["operands"])) for r in add)
    sub = embedded_split("test", ["sub"], per_family=200)
    assert all(("+10=" in r.meta["solution"]) == VARIANTS["sub_borrow"][1](tuple(r.meta["operands"]))
               != VARIANTS["sub_noborrow"][1](tuple(r.meta["operands"])) for r in sub)
    assert 0.2 < len(carry) / len(add) < 0.8


def test_sub_family_names_in_errors():
    with pytest.raises(DataError, match="sub-family: add_carry"):
        embedded_split("test", ["add_carr"], per_family=1)


def test_a_family_and_its_sub_family_together_are_refused():
    with pytest.raises(DataError, match="'add' and 'add_carry' overlap"):
        embedded_split("test", ["add", "add_carry"], per_family=1)
    assert len(embedded_split("test", ["add_nocarry", "add_carry", "sub"], per_family=3)) == 9

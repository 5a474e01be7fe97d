"""The embedded task: seeded, verifiable arithmetic problems with scratchpad solutions.

Dataset id ``embedded:arith-v1``. Every problem has one integer answer and a
deterministic digit-by-digit scratchpad that ends in ``The answer is \\boxed{N}.``.
Tiny models only learn multi-digit arithmetic with such a scratchpad, and because every
model of the zoo is taught the same scratchpad their correct solutions look alike, which
is what GRAFT's compatibility gate (docs/algorithm.md step 9) needs to admit peer responses.

Families (the names are API):

- ``add``: 3-digit + 3-digit.  Columns right to left; each line is
  ``digit+digit+carry=sum r<result so far>``.
- ``sub``: 3-digit - 3-digit with a >= b.  ``top-bottom-borrow[+10]=digit r<so far>``.
- ``mul``: 3-digit x 1-digit (2..9).  ``digit*m+carry=product r<so far>``.
- ``mod``: remainder of a 3-digit number by a 1-digit divisor (2..9), by long division:
  ``<running remainder*10+digit>%d=<new remainder>``.
- ``lin``: solve ``a*x + b = c`` for an integer x (a in 2..9, x in -9..12, b in +-1..20).

Sub-families (``VARIANTS``; not in ``FAMILIES``, so the default dataset is unchanged): a
slice of one family's operands, written, phrased, verified and split exactly as that family
(an operand tuple is in the same split under both names), but labelled with its own name in
``meta["family"]`` so a model can be taught without it and scored on it alone:

- ``add_carry``: the ``add`` problems whose sum has four digits, so the scratchpad ends in a
  carry-out line (``c1 r1<so far>``);
- ``add_nocarry``: the other ``add`` problems (sum below 1000);
- ``sub_borrow``: the ``sub`` problems where some column borrows (a ``top-bottom-borrow+10``
  line); ``sub_noborrow``: the others.

Scratchpad styles (``solution(prompt, style=...)``; the names are API): ``plain`` is the
scratchpad above, the one every prompt's ``meta["solution"]`` holds; ``words`` is the same
computation, step for step, written in words (``2 plus 9 plus 0 is 11, so far 1``) and ending
in ``So the result is \\boxed{N}.``. Both are valid solutions (a verifier reads only the last
``\\boxed{}``); a model taught one finds the other implausible, which is what GRAFT's
compatibility gate is for (the ``complementary`` zoo recipe, graft_fed/zoo/build.py).

Splits are assigned by a hash of the problem's *operands* (family and numbers, not the
phrasing), so the same arithmetic never appears in two splits under different wordings,
and membership does not depend on generation order or on the seed: splits drawn with
different seeds are still disjoint.  The seed only chooses which problems (and which
phrasing) a split holds.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any, Callable, Sequence

from graft_fed.data.prompts import Prompt
from graft_fed.errors import DataError

DATASET_ID = "embedded:arith-v1"
FAMILIES: tuple[str, ...] = ("add", "sub", "mul", "mod", "lin")
SPLITS: tuple[str, ...] = ("train", "validation", "test")
DEFAULT_PER_FAMILY = {"train": 2000, "validation": 100, "test": 200}

# Share of the operand space (out of 100 hash buckets) that belongs to each split.
# Small families (mul, mod, lin: about 7,000 operand tuples each) still give a test
# split of ~700 and a validation split of ~350 distinct problems.
#: Sub-family -> (its family, which of that family's operand tuples belong to it).
VARIANTS: dict[str, tuple[str, Callable[[tuple[int, ...]], bool]]] = {
    "add_carry": ("add", lambda ops: ops[0] + ops[1] >= 1000),
    "add_nocarry": ("add", lambda ops: ops[0] + ops[1] < 1000),
    "sub_borrow": ("sub", lambda ops: _borrows(*ops)),
    "sub_noborrow": ("sub", lambda ops: not _borrows(*ops)),
}


def _borrows(a: int, b: int) -> bool:
    return any(kind == "sub_borrow" for kind, _ in _steps_sub(a, b))


def base_family(family: str) -> str:
    """The family whose problems a family or sub-family name draws (``add_carry`` -> ``add``)."""
    return VARIANTS[family][0] if family in VARIANTS else family


_SPLIT_BUCKETS = {"test": range(0, 10), "validation": range(10, 15), "train": range(15, 100)}

_PHRASINGS: dict[str, tuple[str, ...]] = {
    "add": ("What is {a} + {b}?", "Compute {a} + {b}.", "Find the sum of {a} and {b}.",
            "Calculate {a} + {b}."),
    "sub": ("What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.",
            "Calculate {a} - {b}."),
    "mul": ("What is {a} * {b}?", "Compute {a} * {b}.", "Find the product of {a} and {b}.",
            "Calculate {a} times {b}."),
    "mod": ("What is the remainder when {a} is divided by {b}?", "Compute {a} mod {b}.",
            "Find the remainder of {a} divided by {b}."),
    "lin": ("Solve for x: {a}x {op} {b} = {c}.", "Find x if {a}x {op} {b} = {c}.",
            "If {a}x {op} {b} = {c}, what is x?"),
}


def _phrasing_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for name in ("a", "b", "c"):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>-?\\d+)")
    pattern = pattern.replace(re.escape("{op}"), "(?P<op>[+-])")
    return re.compile("^" + pattern + "$")


_PARSERS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (family, _phrasing_regex(t)) for family, ts in _PHRASINGS.items() for t in ts)


# --- operand sampling -----------------------------------------------------------------

def _operands(family: str, rng: random.Random) -> tuple[int, ...]:
    if family in VARIANTS:
        base, member = VARIANTS[family]
        while True:  # every sub-family holds a large share of its family's operands
            ops = _operands(base, rng)
            if member(ops):
                return ops
    if family == "add":
        return rng.randint(100, 999), rng.randint(100, 999)
    if family == "sub":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return (a, b) if a >= b else (b, a)
    if family in ("mul", "mod"):
        return rng.randint(100, 999), rng.randint(2, 9)
    if family == "lin":
        a, x = rng.randint(2, 9), rng.randint(-9, 12)
        b = rng.choice((-1, 1)) * rng.randint(1, 20)
        return a, b, a * x + b
    raise _unknown_family(family)


def _answer(family: str, ops: tuple[int, ...]) -> int:
    if family == "add":
        return ops[0] + ops[1]
    if family == "sub":
        return ops[0] - ops[1]
    if family == "mul":
        return ops[0] * ops[1]
    if family == "mod":
        return ops[0] % ops[1]
    a, b, c = ops
    return (c - b) // a


def _problem_text(family: str, ops: tuple[int, ...], phrasing: str) -> str:
    if family == "lin":
        a, b, c = ops
        return phrasing.format(a=a, op="+" if b >= 0 else "-", b=abs(b), c=c)
    return phrasing.format(a=ops[0], b=ops[1])


# --- scratchpads ----------------------------------------------------------------------

def _digits_lsb(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]


# Each family's scratchpad is a list of steps, (kind, fields); a style writes every kind of
# step with a template of its own, so the styles cannot drift apart in what they compute.

Step = tuple[str, dict[str, Any]]


def _steps_add(a: int, b: int) -> list[Step]:
    steps, so_far, carry = [], "", 0
    for da, db in zip(_digits_lsb(a), _digits_lsb(b)):
        s = da + db + carry
        so_far = str(s % 10) + so_far
        steps.append(("add", dict(x=da, y=db, carry=carry, out=s, so_far=so_far)))
        carry = s // 10
    if carry:
        steps.append(("carry", dict(carry=carry, so_far=so_far)))
    return steps


def _steps_sub(a: int, b: int) -> list[Step]:
    steps, so_far, borrow = [], "", 0
    for da, db in zip(_digits_lsb(a), _digits_lsb(b)):
        d = da - db - borrow
        kind = "sub_borrow" if d < 0 else "sub"
        used = borrow
        borrow = 1 if d < 0 else 0
        d += 10 * borrow
        so_far = str(d) + so_far
        steps.append((kind, dict(x=da, y=db, borrow=used, out=d, so_far=so_far)))
    return steps


def _steps_mul(a: int, m: int) -> list[Step]:
    steps, so_far, carry = [], "", 0
    for da in _digits_lsb(a):
        p = da * m + carry
        so_far = str(p % 10) + so_far
        steps.append(("mul", dict(x=da, m=m, carry=carry, out=p, so_far=so_far)))
        carry = p // 10
    if carry:
        steps.append(("carry", dict(carry=carry, so_far=so_far)))
    return steps


def _steps_mod(a: int, d: int) -> list[Step]:
    steps, rem = [], 0
    for digit in str(a):
        cur = rem * 10 + int(digit)
        rem = cur % d
        steps.append(("mod", dict(cur=cur, d=d, rem=rem)))
    return steps


def _steps_lin(a: int, b: int, c: int) -> list[Step]:
    rhs = c - b
    move = ("lin_minus", dict(a=a, c=c, b=b, rhs=rhs)) if b >= 0 else ("lin_plus", dict(a=a, c=c, b=-b, rhs=rhs))
    return [move, ("lin_div", dict(a=a, rhs=rhs, x=rhs // a))]


_STEPS: dict[str, Callable[..., list[Step]]] = {
    "add": _steps_add, "sub": _steps_sub, "mul": _steps_mul, "mod": _steps_mod, "lin": _steps_lin}

#: Scratchpad styles: name -> (a template per kind of step, the closing line). `plain` is the
#: scratchpad the zoo was always taught; `words` writes the same steps in words.
STYLES: dict[str, tuple[dict[str, str], str]] = {
    "plain": ({"add": "{x}+{y}+{carry}={out} r{so_far}", "carry": "c{carry} r{carry}{so_far}",
               "sub": "{x}-{y}-{borrow}={out} r{so_far}", "sub_borrow": "{x}-{y}-{borrow}+10={out} r{so_far}",
               "mul": "{x}*{m}+{carry}={out} r{so_far}", "mod": "{cur}%{d}={rem}",
               "lin_minus": "{a}x={c}-{b}={rhs}", "lin_plus": "{a}x={c}+{b}={rhs}", "lin_div": "x={rhs}/{a}={x}"},
              "The answer is \\boxed{{{}}}."),
    "words": ({"add": "{x} plus {y} plus {carry} is {out}, so far {so_far}",
               "carry": "carry {carry}, so far {carry}{so_far}",
               "sub": "{x} minus {y} minus {borrow} is {out}, so far {so_far}",
               "sub_borrow": "{x} minus {y} minus {borrow} plus 10 is {out}, so far {so_far}",
               "mul": "{x} times {m} plus {carry} is {out}, so far {so_far}", "mod": "{cur} mod {d} is {rem}",
               "lin_minus": "{a}x is {c} minus {b}, which is {rhs}", "lin_plus": "{a}x is {c} plus {b}, which is {rhs}",
               "lin_div": "x is {rhs} over {a}, which is {x}"},
              "So the result is \\boxed{{{}}}."),
}


def _solution_text(family: str, ops: tuple[int, ...], style: str = "plain") -> str:
    if style not in STYLES:
        raise DataError(f"unknown scratchpad style {style!r}; choose from {', '.join(STYLES)}")
    templates, closing = STYLES[style]
    lines = [templates[kind].format(**fields) for kind, fields in _STEPS[family](*ops)]
    lines.append(closing.format(_answer(family, ops)))
    return "\n".join(lines)


# --- public API -----------------------------------------------------------------------

def _unknown_family(family: str) -> DataError:
    return DataError(f"unknown embedded task family {family!r}; choose from "
                     f"{', '.join(FAMILIES)} or a sub-family: {', '.join(VARIANTS)}")


def _require_known(family: str) -> None:
    if family not in FAMILIES and family not in VARIANTS:
        raise _unknown_family(family)


def _check_families(families: Sequence[str] | None) -> tuple[str, ...]:
    if families is None:
        return FAMILIES
    if isinstance(families, str):
        families = [families]
    for f in families:
        _require_known(f)
    for f in families:
        if f in VARIANTS and VARIANTS[f][0] in families:
            raise DataError(f"families {VARIANTS[f][0]!r} and {f!r} overlap ({f} is a slice of {VARIANTS[f][0]}): "
                            f"the same problem would appear twice; name the family or its sub-families, not both")
    return tuple(dict.fromkeys(families))


def _make(family: str, ops: tuple[int, ...], phrasing: str) -> Prompt:
    base = base_family(family)
    return Prompt.make(DATASET_ID, _problem_text(base, ops, phrasing), str(_answer(base, ops)),
                       family=family, operands=list(ops), solution=_solution_text(base, ops))


def make_prompt(family: str, rng: random.Random) -> Prompt:
    """One random problem of `family` (or sub-family); meta holds family, operands and the
    scratchpad."""
    _require_known(family)
    ops = _operands(family, rng)
    return _make(family, ops, rng.choice(_PHRASINGS[base_family(family)]))


def _parse(prompt: Prompt) -> tuple[str, tuple[int, ...]]:
    meta = prompt.meta or {}
    family, ops = meta.get("family"), meta.get("operands")
    if (family in FAMILIES or family in VARIANTS) and ops:
        return family, tuple(int(x) for x in ops)
    family = base_family(family) if isinstance(family, str) else family
    text = " ".join(prompt.problem.split())
    for fam, rx in _PARSERS:
        if family not in (None, fam):
            continue
        m = rx.match(text)
        if m:
            if fam == "lin":
                b = int(m["b"]) * (1 if m["op"] == "+" else -1)
                return fam, (int(m["a"]), b, int(m["c"]))
            return fam, (int(m["a"]), int(m["b"]))
    raise DataError(f"prompt {prompt.id} ({prompt.problem!r}) is not an embedded task problem; "
                    f"solution() only knows the families {', '.join(FAMILIES)}")


def solution(prompt: Prompt, style: str = "plain") -> str:
    """The scratchpad solution of an embedded-task prompt, re-derived from the problem, in
    scratchpad style `style` (see STYLES; the default is the one in ``meta["solution"]``)."""
    family, ops = _parse(prompt)
    return _solution_text(base_family(family), ops, style)


def family_of(prompt: Prompt) -> str:
    """The prompt's family, or its sub-family where ``meta`` names one."""
    return _parse(prompt)[0]


def _split_bucket(family: str, ops: tuple[int, ...]) -> int:
    key = f"{DATASET_ID}|{base_family(family)}|{','.join(map(str, ops))}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100


def split_of(prompt: Prompt) -> str:
    """The split an embedded-task prompt belongs to (a pure function of its operands)."""
    family, ops = _parse(prompt)
    bucket = _split_bucket(family, ops)
    return next(s for s, r in _SPLIT_BUCKETS.items() if bucket in r)


def embedded_split(split: str, families: Sequence[str] | None = None,
                   per_family: int | None = None, seed: int = 0) -> list[Prompt]:
    """`per_family` distinct problems of each family that belong to `split`.

    Deterministic in (split, families, per_family, seed); the rows are ordered family by
    family in the order given, each family in generation order.
    """
    if split not in SPLITS:
        raise DataError(f"unknown embedded task split {split!r}; choose from {', '.join(SPLITS)}")
    fams = _check_families(families)
    n = DEFAULT_PER_FAMILY[split] if per_family is None else int(per_family)
    if n < 0:
        raise DataError(f"per_family must be >= 0, got {n}")
    buckets = _SPLIT_BUCKETS[split]
    out: list[Prompt] = []
    for family in fams:
        rng = random.Random(f"{DATASET_ID}|{split}|{family}|{seed}")
        seen: set[tuple[int, ...]] = set()
        rows: list[Prompt] = []
        attempts, budget = 0, 60 * n + 2000
        while len(rows) < n:
            attempts += 1
            if attempts > budget:
                raise DataError(
                    f"could only find {len(rows)} distinct {family!r} problems for split {split!r} "
                    f"(asked for {n}); the family's operand space is too small: ask for fewer")
            ops = _operands(family, rng)
            phrasing = rng.choice(_PHRASINGS[base_family(family)])
            if ops in seen or _split_bucket(family, ops) not in buckets:
                continue
            seen.add(ops)
            rows.append(_make(family, ops, phrasing))
        out.extend(rows)
    return out

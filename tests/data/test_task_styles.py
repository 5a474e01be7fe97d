"""Scratchpad styles of the embedded task (issue 15): the default is today's text, byte for
byte; the `words` style is a different but valid solution of the same problem."""

import pytest

from graft_fed.data.task import FAMILIES, STYLES, embedded_split, solution
from graft_fed.errors import DataError
from graft_fed.zoo.measure import boxed_answer


def test_the_default_style_is_the_prompt_s_own_scratchpad_byte_for_byte():
    for p in embedded_split("test", FAMILIES, per_family=20, seed=3):
        assert solution(p) == p.meta["solution"] == solution(p, "plain")
        assert solution(p).endswith(f"The answer is \\boxed{{{p.answer}}}.")


def test_words_style_differs_visibly_and_boxes_the_same_answer():
    assert set(STYLES) == {"plain", "words"}
    for p in embedded_split("test", FAMILIES, per_family=20, seed=3):
        plain, words = solution(p), solution(p, "words")
        assert words != plain and boxed_answer(words) == boxed_answer(plain) == p.answer
        assert len(words.splitlines()) == len(plain.splitlines())  # the same steps, one line each
        assert any(w in words for w in (" plus ", " minus ", " times ", " mod ", " over "))


def test_an_unknown_style_is_refused():
    p = embedded_split("test", ["add"], per_family=1)[0]
    with pytest.raises(DataError, match="unknown scratchpad style"):
        solution(p, "emoji")

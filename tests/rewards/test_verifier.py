import threading
import time
import types
from pathlib import Path

import pytest

from graft_fed.data.loaders import BENCHMARKS, load_benchmark
from graft_fed.errors import ConfigError
from graft_fed.rewards import Verifier, VerifierConfig, build_verifier
from graft_fed.rewards import pool as pool_module

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
PLUGINS = "tests.rewards.verifier_plugins"


@pytest.fixture(scope="module")
def mv():
    """math-verify with the fast path OFF, so every item really goes through math-verify."""
    with build_verifier(VerifierConfig(exact_match_fast_path=False, timeout_s=20.0)) as verifier:
        yield verifier


def test_is_a_verifier_with_math_verify_version(mv):
    import importlib.metadata

    assert isinstance(mv, Verifier)
    assert mv.name == "math_verify"
    assert mv.version == importlib.metadata.version("math-verify")


@pytest.mark.parametrize("response, gold, reward", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "0.5", 1.0),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("first \\boxed{3}, finally \\fbox{4}", "4", 1.0),
    ("\\boxed{4} was wrong, it is \\boxed{3}", "4", 0.0),
    ("\\boxed{2}", "3", 0.0),
])
def test_equivalent_and_wrong_answers(mv, response, gold, reward):
    result = mv.score([response], [gold])
    assert result.rewards == [reward]
    assert result.statuses == ["ok"] and result.timeouts == result.errors == 0


def test_no_boxed_answer_scores_zero_without_math_verify(mv):
    result = mv.score(["the answer is 1/2", "\\boxed{1/2"], ["1/2", "1/2"])
    assert result.rewards == [0.0, 0.0]
    assert result.statuses == ["no_boxed", "no_boxed"] and result.no_boxed == 2


def test_empty_batch_and_length_mismatch(mv):
    assert mv.score([], []).rewards == []
    with pytest.raises(ValueError, match="one answer per response"):
        mv.score(["\\boxed{1}"], [])


def test_fast_path_is_on_by_default_and_switchable():
    responses, golds = ["\\boxed{ 42 }", "\\boxed{42.0}"], ["42", "42"]
    with build_verifier(VerifierConfig()) as fast:
        result = fast.score(responses, golds)
    assert result.rewards == [1.0, 1.0]
    assert result.statuses == ["fast_path", "ok"] and result.fast_path == 1


def test_fixture_benchmark_golds_score_one_when_given_back_boxed(mv):
    prompts = [p for name in BENCHMARKS for p in load_benchmark(name, root=FIXTURES)]
    assert len(prompts) == 3 * len(BENCHMARKS)
    result = mv.score(["\\boxed{" + p.answer + "}" for p in prompts], [p.answer for p in prompts])
    failed = [p.answer for p, r in zip(prompts, result.rewards) if r != 1.0]
    assert failed == [] and set(result.statuses) == {"ok"}


def test_scoring_off_the_main_thread(mv):
    """math-verify's own signal.alarm timeouts fail off the main thread; the pool does not care."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=mv.score(["\\boxed{0.25}"], ["\\frac14"])),
                              daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "scoring off the main thread did not finish within 30 s"
    assert out["r"].rewards == [1.0]


def test_hung_item_times_out_at_the_wall_clock_and_the_pool_carries_on():
    cfg = VerifierConfig(name=f"{PLUGINS}:exact", isolate_plugin=True, workers=1, chunk_size=8, timeout_s=1.0)
    with build_verifier(cfg) as verifier:
        verifier.score(["warm"], ["warm"])  # worker start-up is not part of the item's clock
        start = time.monotonic()
        result = verifier.score(["a", "hang", "b", "c"], ["a", "x", "b", "c"])
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, 0.0, 1.0, 1.0]
        assert result.statuses == ["ok", "timeout", "ok", "ok"]
        assert result.timeouts == 1 and result.errors == 0
        assert 1.0 <= elapsed < 10.0
        assert verifier.restarts == 1
        assert verifier.score(["d"], ["d"]).rewards == [1.0]


def test_worker_crash_is_counted_as_an_error_and_costs_only_that_item():
    cfg = VerifierConfig(name=f"{PLUGINS}:exact", isolate_plugin=True, workers=2, chunk_size=4, timeout_s=10.0)
    with build_verifier(cfg) as verifier:
        result = verifier.score(["a", "crash", "b", "raise", "c"], ["a", "a", "b", "b", "c"])
        assert result.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert result.statuses == ["ok", "error", "ok", "error", "ok"]
        assert result.errors == 2 and result.timeouts == 0
        assert verifier.score(["e"], ["e"]).rewards == [1.0]


def _slow_pool_clock(monkeypatch) -> None:
    """The pool's clock takes 200 ms per reading: the parent's passes become slow enough for
    a worker's answers and death to fall between two of its steps, in a known order."""
    real_monotonic = time.monotonic

    def slow_monotonic() -> float:
        time.sleep(0.2)
        return real_monotonic()

    monkeypatch.setattr(pool_module, "time", types.SimpleNamespace(monotonic=slow_monotonic))


def _score_within(verifier, responses, answers, limit_s: float = 60.0):
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=verifier.score(responses, answers)), daemon=True)
    thread.start()
    thread.join(timeout=limit_s)
    assert not thread.is_alive(), "the pool lost the dead worker's items and waited for them"
    return out["r"]


def test_a_worker_that_dies_after_the_parent_last_looked_costs_only_its_item(monkeypatch):
    """CI once hung for 90 minutes on the test above: a worker that answered an item and
    died on the next one between the parent's look at it and its next dispatch pass was
    replaced there without its chunk being accounted for; those items were lost and the
    pool waited, without a deadline, for answers that could not come. With the slow clock
    the chunk goes out at D, 'a' is answered at once, the parent reads the clock three
    times before it sees the worker alive (D+600 ms), the worker dies at D+700 ms, and the
    next pass looks at D+800."""
    _slow_pool_clock(monkeypatch)
    cfg = VerifierConfig(name=f"{PLUGINS}:exact", isolate_plugin=True, workers=1, chunk_size=8, timeout_s=30.0)
    with build_verifier(cfg) as verifier:
        result = _score_within(verifier, ["a", "die_soon", "b"], ["a", "a", "b"])
        assert result.statuses == ["ok", "error", "ok"]
        assert result.rewards == [1.0, 0.0, 1.0]
        assert verifier.restarts == 1


def test_an_answer_sent_just_before_a_worker_died_is_read_not_scored_as_its_crash(monkeypatch):
    """The parent asks whether a worker is alive before it reads the worker's answers: asked
    after, an answer that arrived in between was left unread and its item scored as the
    crash (and the item that crashed re-run). With the slow clock 'a' is read at about
    D+400 ms, 'slow:b' is answered at D+500 and 'crash' dies at once; the parent's look
    after its reading came at D+600."""
    _slow_pool_clock(monkeypatch)
    cfg = VerifierConfig(name=f"{PLUGINS}:exact", isolate_plugin=True, workers=1, chunk_size=8, timeout_s=30.0)
    with build_verifier(cfg) as verifier:
        result = _score_within(verifier, ["a", "slow:b", "crash", "c"], ["a", "b", "a", "c"])
        assert result.statuses == ["ok", "ok", "error", "ok"]
        assert result.rewards == [1.0, 1.0, 0.0, 1.0]
        assert verifier.restarts == 1


def test_workers_that_never_finish_starting_disable_the_pool_after_three_tries(monkeypatch, caplog):
    """A start-up that hangs (an import stuck on a network drive, say) counts as a failed
    start like a crash does: three in a row and every item scores 0 as an error, instead
    of the pool replacing workers for ever."""
    monkeypatch.setattr(pool_module, "_STARTUP_TIMEOUT_S", 1.0)
    pool = pool_module.KillablePool("tests.rewards.slow_import_plugin:f", workers=1, timeout_s=1.0,
                                    chunk_size=1, start_method="spawn")
    try:
        with caplog.at_level("ERROR", logger=pool_module.__name__):
            assert pool.run([("a", "a"), ("b", "b")]) == [(0.0, "error"), (0.0, "error")]
        assert "3 verifier workers in a row failed to start (last: no answer within 1 s)" in caplog.text
        assert pool.run([("c", "c")]) == [(0.0, "error")]  # disabled: no fourth try
    finally:
        pool.close()


def test_in_process_plugin_errors_and_bad_values_score_zero_and_are_counted():
    with build_verifier(VerifierConfig(name=f"{PLUGINS}:bad_value")) as verifier:
        result = verifier.score(["two", "nan", "text", "neg", "true", "missing"], [""] * 6)
    assert result.rewards == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert result.statuses == ["error", "error", "ok", "error", "ok", "error"]
    assert result.errors == 4
    with build_verifier(VerifierConfig(name=f"{PLUGINS}:exact")) as verifier:
        assert verifier.name == f"{PLUGINS}:exact" and verifier.version == "unversioned"
        result = verifier.score(["a", "raise"], ["a", "a"])
    assert result.rewards == [1.0, 0.0] and result.errors == 1


@pytest.mark.parametrize("name, fragment", [
    ("tests.rewards.no_such_module:f", "cannot import module"),
    (f"{PLUGINS}:missing", "has no attribute"),
    (f"{PLUGINS}:NOT_CALLABLE", "not a function"),
    (f"{PLUGINS}:one_argument", "f\\(response, answer\\)"),
])
def test_plugin_loading_errors_are_config_errors(name, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_verifier(VerifierConfig(name=name))


def test_a_real_math_verify_hang_is_cut_at_the_wall_clock():
    """sympy tries to evaluate this tower of powers for ever; math-verify's own timeout is off."""
    with build_verifier(VerifierConfig(exact_match_fast_path=False, workers=1, timeout_s=1.0)) as verifier:
        verifier.score(["\\boxed{1}"], ["1"])
        start = time.monotonic()
        result = verifier.score(["\\boxed{10^{10^{10^{10^{10}}}}}", "\\boxed{2}"], ["3", "2"])
        assert time.monotonic() - start < 10.0
    assert result.rewards == [0.0, 1.0] and result.statuses == ["timeout", "ok"] and result.timeouts == 1

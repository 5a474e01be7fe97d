"""Verifiers: binary rewards for responses against gold answers (docs/algorithm.md step 3).

A verification that times out, crashes or errors scores 0 and is counted in the
ScoreResult; it is never raised into the caller.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from graft_fed.errors import ConfigError
from graft_fed.rewards.boxed import last_boxed, normalise_ws
from graft_fed.rewards.config import MATH_VERIFY, VerifierConfig
from graft_fed.rewards.pool import ERROR, OK, TIMEOUT, KillablePool, check_reward

log = logging.getLogger(__name__)

#: Per-item statuses. "ok": the verifier ran and returned its reward; "fast_path": exact
#: match, math-verify not called; "no_boxed": the response has no (closed) final
#: \boxed{}, scored 0 without calling math-verify; "timeout" / "error": scored 0, counted.
STATUSES = (OK, "fast_path", "no_boxed", TIMEOUT, ERROR)
_MATH_VERIFY_ITEM = "graft_fed.rewards.mathverify:score"


@dataclass
class ScoreResult:
    """Rewards of one batch, in input order, with what happened on the way."""

    rewards: list[float]
    statuses: list[str] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0
    fast_path: int = 0
    no_boxed: int = 0

    @classmethod
    def from_statuses(cls, rewards: list[float], statuses: list[str]) -> "ScoreResult":
        return cls(rewards=rewards, statuses=statuses, timeouts=statuses.count(TIMEOUT),
                   errors=statuses.count(ERROR), fast_path=statuses.count("fast_path"),
                   no_boxed=statuses.count("no_boxed"))


@runtime_checkable
class Verifier(Protocol):
    name: str
    version: str

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> ScoreResult: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Verifier": ...

    def __exit__(self, *exc: object) -> None: ...


def _check_lengths(responses: Sequence[str], answers: Sequence[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"score() needs one answer per response, got {len(responses)} responses "
                         f"and {len(answers)} answers")


class _Closing:
    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass


class _PoolVerifier(_Closing):
    """Scores items in a KillablePool; the pool starts on first use and is reused."""

    def __init__(self, cfg: VerifierConfig, target: str) -> None:
        self.cfg = cfg
        self._pool = KillablePool(target, cfg.workers, cfg.timeout_s, cfg.chunk_size, cfg.start_method)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def restarts(self) -> int:
        """Workers replaced so far (after a timeout or a crash)."""
        return self._pool.restarts

    def _run(self, items: list[tuple[str, str]]) -> list[tuple[float, str]]:
        with self._lock:
            return self._pool.run(items)

    def close(self) -> None:
        # After any score() in progress (bounded by the per-item wall clock): closing the
        # pool under a running score() would leave that call without workers.
        with self._lock:
            self._finalizer()


class MathVerifyVerifier(_PoolVerifier):
    """math-verify on the last \\boxed{} of each response, gold boxed and passed first."""

    name = MATH_VERIFY

    def __init__(self, cfg: VerifierConfig) -> None:
        super().__init__(cfg, _MATH_VERIFY_ITEM)
        self.version = importlib.metadata.version("math-verify")

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        _check_lengths(responses, answers)
        rewards = [0.0] * len(responses)
        statuses = [""] * len(responses)
        todo: list[int] = []
        items: list[tuple[str, str]] = []
        for i, (response, answer) in enumerate(zip(responses, answers)):
            if not isinstance(response, str) or not isinstance(answer, str):
                statuses[i] = ERROR
                continue
            content = last_boxed(response)
            if content is None:
                statuses[i] = "no_boxed"
            elif self.cfg.exact_match_fast_path and normalise_ws(content) == normalise_ws(answer):
                rewards[i], statuses[i] = 1.0, "fast_path"
            else:
                todo.append(i)
                # Ship only the final box: the worker extracts the same content from it.
                items.append(("\\boxed{" + content + "}", answer))
        for i, (value, status) in zip(todo, self._run(items)):
            rewards[i], statuses[i] = value, status
        return ScoreResult.from_statuses(rewards, statuses)


class PluginVerifier(_Closing):
    """A user function `(response, answer) -> float in [0, 1]`, called in-process."""

    def __init__(self, spec: str, fn: Callable[[str, str], Any]) -> None:
        self.name = spec
        self.version = _plugin_version(spec, fn)
        self._fn = fn

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        _check_lengths(responses, answers)
        rewards, statuses = [], []
        for response, answer in zip(responses, answers):
            try:
                reward, status = check_reward(self._fn(response, answer)), OK
            except Exception as exc:
                log.debug("plugin %s failed: %s: %s", self.name, type(exc).__name__, exc)
                reward, status = 0.0, ERROR
            rewards.append(reward)
            statuses.append(status)
        return ScoreResult.from_statuses(rewards, statuses)


class IsolatedPluginVerifier(_PoolVerifier):
    """A plugin run in the killable pool: same timeout and crash handling as math-verify."""

    def __init__(self, cfg: VerifierConfig, fn: Callable[[str, str], Any]) -> None:
        super().__init__(cfg, cfg.name)
        self.name = cfg.name
        self.version = _plugin_version(cfg.name, fn)

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        _check_lengths(responses, answers)
        values = self._run(list(zip(responses, answers)))
        return ScoreResult.from_statuses([v for v, _ in values], [s for _, s in values])


def _plugin_version(spec: str, fn: Any) -> str:
    module = importlib.import_module(spec.partition(":")[0])
    version = getattr(fn, "__version__", None) or getattr(module, "__version__", None)
    return str(version) if version is not None else "unversioned"


def load_plugin(spec: str) -> Callable[[str, str], Any]:
    """Import and check a "package.module:function" plugin; ConfigError saying what is wrong."""
    module_name, _, attr_path = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"verifier plugin {spec!r}: cannot import module {module_name!r} ({exc}); "
                          "install it or put its directory on PYTHONPATH") from None
    except Exception as exc:
        raise ConfigError(f"verifier plugin {spec!r}: importing {module_name!r} failed with "
                          f"{type(exc).__name__}: {exc}") from None
    obj: Any = module
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"verifier plugin {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(f"verifier plugin {spec!r} is a {type(obj).__name__}, not a function "
                          "(response: str, answer: str) -> float")
    try:
        inspect.signature(obj).bind("response", "answer")
    except TypeError:
        raise ConfigError(f"verifier plugin {spec!r} cannot be called as f(response, answer); "
                          "it must take exactly those two positional arguments") from None
    except ValueError:
        pass  # some builtins have no introspectable signature; calls will tell
    return obj


def build_verifier(cfg: VerifierConfig) -> Verifier:
    """The verifier `cfg` names. Pool workers start on the first score() that needs them."""
    if cfg.name == MATH_VERIFY:
        return MathVerifyVerifier(cfg)
    fn = load_plugin(cfg.name)
    if cfg.isolate_plugin:
        return IsolatedPluginVerifier(cfg, fn)
    return PluginVerifier(cfg.name, fn)

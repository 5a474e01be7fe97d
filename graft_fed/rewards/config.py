"""Configuration of the reward verifier."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from graft_fed.configbase import require

MATH_VERIFY = "math_verify"
START_METHODS = ("forkserver", "spawn")
_PLUGIN_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class VerifierConfig:
    """How responses are scored against gold answers (binary reward, docs/algorithm.md step 3)."""

    #: "math_verify" (math-verify on the last \boxed{} answer, run in a killable process
    #: pool), or "package.module:function" naming a plugin `(response, answer) -> float`
    #: in [0, 1].
    name: str = MATH_VERIFY
    #: Wall-clock limit in seconds for scoring ONE response, enforced by the parent
    #: process; past it the worker is killed and replaced and the item scores 0 (counted
    #: as a timeout). Does not apply to plugins run in-process.
    timeout_s: float = 5.0
    #: Number of worker processes in the verification pool.
    workers: int = 2
    #: Score 1 without calling math-verify when the last boxed answer equals the gold
    #: string up to whitespace (math_verify only; plugins always see every response).
    exact_match_fast_path: bool = True
    #: Items sent to a worker per message; larger amortises IPC, and a hang still costs
    #: only the hung item (the rest of its chunk is re-submitted).
    chunk_size: int = 16
    #: How pool workers are started: "forkserver" (fast replacement of killed workers)
    #: or "spawn". Never "fork": the parent runs torch threads.
    start_method: str = "forkserver"
    #: Run a plugin in the killable pool too (timeouts and crashes contained, at the cost
    #: of IPC; the plugin must be importable in a fresh process). Default: in-process.
    isolate_plugin: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and (self.name == MATH_VERIFY or bool(_PLUGIN_RE.match(self.name))),
                f"verifier.name {self.name!r} must be {MATH_VERIFY!r} or 'package.module:function' naming "
                "a plugin (response: str, answer: str) -> float in [0, 1]")
        require(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                and math.isfinite(self.timeout_s) and self.timeout_s > 0,
                f"verifier.timeout_s must be a positive number of seconds, got {self.timeout_s!r}; 5.0 is a good default")
        require(isinstance(self.workers, int) and not isinstance(self.workers, bool) and self.workers >= 1,
                f"verifier.workers must be an integer >= 1, got {self.workers!r}")
        require(isinstance(self.chunk_size, int) and not isinstance(self.chunk_size, bool) and self.chunk_size >= 1,
                f"verifier.chunk_size must be an integer >= 1, got {self.chunk_size!r}; 16 is a good default")
        require(isinstance(self.exact_match_fast_path, bool),
                f"verifier.exact_match_fast_path must be true or false, got {self.exact_match_fast_path!r}")
        require(self.start_method in START_METHODS,
                f"verifier.start_method must be one of {START_METHODS}, got {self.start_method!r} "
                "('fork' is unsafe in a process running torch threads)")
        require(isinstance(self.isolate_plugin, bool),
                f"verifier.isolate_plugin must be true or false, got {self.isolate_plugin!r}")

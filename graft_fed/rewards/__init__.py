"""Verifiers: binary verifiable rewards (math-verify in a killable process pool, or a plugin)."""

from graft_fed.rewards.boxed import last_boxed
from graft_fed.rewards.config import VerifierConfig
from graft_fed.rewards.files import score_files
from graft_fed.rewards.verifier import ScoreResult, Verifier, build_verifier

__all__ = ["ScoreResult", "Verifier", "VerifierConfig", "build_verifier", "last_boxed", "score_files"]

"""Rollout engines: sample n responses per prompt with per-token behaviour log-probs."""

from graft_fed.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]

"""Group-relative advantages (docs/algorithm.md step 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

ScaleRewards = Literal["group", "none"]
StdKind = Literal["sample", "population"]
# The choices, for configs and the federation manifest (which must not load torch).
SCALES: tuple[ScaleRewards, ...] = ("group", "none")
STDS: tuple[StdKind, ...] = ("sample", "population")


def advantage_id(scale_rewards: str, std: str) -> str:
    """How a run normalises its group advantages (`algorithm.scale_rewards`, `algorithm.std`),
    as "<scale_rewards>/<std>", e.g. "group/sample". A receiver trains on the SOURCE's
    advantages (docs/algorithm.md step 7), so a federation's manifest pins it and a stored
    run records it."""
    return f"{scale_rewards}/{std}"


ADVANTAGES = tuple(advantage_id(scale, std) for scale in SCALES for std in STDS)
# The paper's (and the trainer's default).
PAPER_ADVANTAGE = advantage_id("group", "sample")


def group_advantages(rewards: torch.Tensor, scale: ScaleRewards = "group", std: StdKind = "sample",
                     eps: float = 1e-6) -> torch.Tensor:
    """a_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    rewards: (G, n) one row per prompt group. Returns (G, n).
    `std="sample"` is torch.std's n-1 denominator, as verl (the paper's trainer) computes
    it; "population" (n denominator) is offered as a documented deviation. `scale="none"`
    skips the division (Dr. GRPO). A group whose rewards are all equal gets exactly zero
    advantages, and so does a group of one response.
    """
    import torch

    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (groups, n), got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # (G, n)
    if scale == "none":
        adv = centred
    elif scale == "group":
        n = rewards.shape[1]
        if n < 2:
            return torch.zeros_like(rewards)
        sd = rewards.std(dim=1, keepdim=True, correction=1 if std == "sample" else 0)  # (G, 1)
        adv = centred / (sd + eps)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}")
    # Exact zeros for zero-variance groups, whatever the float noise of the mean.
    flat = (rewards.max(dim=1, keepdim=True).values == rewards.min(dim=1, keepdim=True).values)
    return adv.masked_fill(flat, 0.0)


def successes(rewards: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """k(q): number of successful responses per group on the binary outcome. (G, n) -> (G,)"""
    return (rewards > threshold).sum(dim=1)

"""A receiver's screening of a peer group before it trains on it, and the optimiser's guard
after (issue 12, "poisoning a receiver"). Pure functions: the receiver
(graft_fed.graft.receive.receive) and the optimiser (GRPOTrainer.optimise) call them.

What a source claims and what the receiver can check:

- rewards: re-verified by the receiver with its own verifier (trainer/graft.py).
- advantages: under whole-group transfer they are a deterministic function of the rewards
  (Eq. 1, graft_fed/core/advantages.py group_advantages, with the federation's
  scale_rewards and std): the receiver recomputes them from the rewards it re-verified
  (`expected_advantages`) and refuses a record whose claim differs beyond a tolerance
  (`check_advantages`); it then trains on its own numbers, not on the claim.
- mean generation log-probs lbar_S: the compatibility gate s = exp(lbar_R - lbar_S) uses the
  source's claim, which the receiver cannot recompute (it does not hold the source's
  model). `check_source_logprobs` bounds them to what sampling produces: a claim of -1e6
  per token would make s astronomically large and admit every response at full weight.
  Within the bound a lying source can still inflate s for its responses; the gate caps the
  weight at 1 and the rewards are re-verified, so what it buys is off-policy weight on
  correct responses, not wrong rewards (docs/security.md).
- the update: whatever got through, a non-finite loss or gradient skips the optimiser step
  (`update_is_finite`), is counted, and the peer groups of the minibatch are reported
  against their sources (`peer_groups_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from graft_fed.core.advantages import group_advantages
from graft_fed.core.records import MIN_MEAN_LOGPROB, GroupRecord, RecordError, max_abs_advantage


class ScreeningError(RecordError):
    """A peer group refused by screening; `reason` is a short metric-friendly key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ScreenSettings:
    """The receiver's screening settings; `scale` and `std` must be the federation's
    (the receiver's algorithm.scale_rewards and algorithm.std: every node of a federation
    computes Eq. 1 the same way)."""

    scale: str = "group"
    std: str = "sample"
    eps: float = 1e-6
    #: |claimed - recomputed| allowed per advantage, relative to max(1, |recomputed|)
    advantage_tol: float = 1e-3
    #: the lowest mean per-token generation log-prob a source may claim (see
    #: core.records.MIN_MEAN_LOGPROB, the hard bound every record already meets; this one
    #: is the receiver's, at or above it)
    min_mean_logprob: float = -20.0
    #: characters of one peer response the receiver will re-tokenise (a bundle of up to
    #: max_bundle_mib could otherwise carry one 64 MiB "response")
    max_text_chars: int = 256 * 1024


def expected_advantages(rewards: Sequence[float], scale: str = "group", std: str = "sample",
                        eps: float = 1e-6) -> tuple[float, ...]:
    """Eq. 1 on one group's rewards, exactly as a node computes its own (float32 values)."""
    if not rewards:
        return ()
    adv = group_advantages(torch.tensor([list(rewards)], dtype=torch.float32), scale=scale,  # type: ignore[arg-type]
                           std=std, eps=eps)  # type: ignore[arg-type]
    return tuple(float(a) for a in adv[0].tolist())


def check_advantages(rewards: Sequence[float], claimed: Sequence[float],
                     settings: ScreenSettings = ScreenSettings()) -> tuple[float, ...]:
    """The advantages to train on: recomputed from the (re-verified) rewards. Raises
    ScreeningError("advantages") when the claimed ones differ beyond the tolerance, are not
    finite, or are beyond what Eq. 1 gives any binary group of that size."""
    if len(rewards) != len(claimed):
        raise ScreeningError("advantages", f"{len(claimed)} advantages for {len(rewards)} rewards")
    bound = max_abs_advantage(len(rewards))
    for a in claimed:
        if not math.isfinite(a) or abs(a) > bound:
            raise ScreeningError("advantages", f"claimed advantage {a!r} is not one Eq. 1 gives a group of "
                                               f"{len(rewards)} binary rewards (|a| <= {bound:.3f})")
    mine = expected_advantages(rewards, settings.scale, settings.std, settings.eps)
    for i, (c, m) in enumerate(zip(claimed, mine)):
        if abs(c - m) > settings.advantage_tol * max(1.0, abs(m)):
            raise ScreeningError("advantages", f"claimed advantage {c:+.6g} of response {i} differs from "
                                               f"{m:+.6g}, what Eq. 1 gives its rewards (scale_rewards="
                                               f"{settings.scale}, std={settings.std})")
    return mine


def check_source_logprobs(mean_logprobs: Sequence[float],
                          settings: ScreenSettings = ScreenSettings()) -> None:
    """Raise ScreeningError("logprobs") unless every claimed mean generation log-prob is
    finite and in [settings.min_mean_logprob, 0]."""
    floor = max(settings.min_mean_logprob, MIN_MEAN_LOGPROB)
    for i, lp in enumerate(mean_logprobs):
        if not (math.isfinite(lp) and floor <= lp <= 1e-6):
            raise ScreeningError("logprobs", f"claimed mean log-prob {lp!r} of response {i} is outside "
                                             f"[{floor}, 0]: no sampled response has it")


def screen_record(rec: GroupRecord, settings: ScreenSettings = ScreenSettings(),
                  rewards: Sequence[float] | None = None) -> tuple[float, ...]:
    """All of a receiver's checks of a peer group that need no model: the record's own
    validation, the claimed log-probs, and the claimed advantages against Eq. 1 on
    `rewards` (the rewards the receiver re-verified; the record's when None, for a check
    before re-verification). Returns the advantages to train on; raises ScreeningError
    (a RecordError) naming the reason."""
    try:
        rec.validate()
    except ScreeningError:
        raise
    except RecordError as exc:
        raise ScreeningError("malformed", str(exc)) from None
    check_source_logprobs(rec.mean_logprobs, settings)
    for i, t in enumerate(rec.texts):
        if len(t) > settings.max_text_chars:
            raise ScreeningError("too_long", f"response {i} has {len(t)} characters; at most "
                                             f"{settings.max_text_chars}")
    return check_advantages(list(rec.rewards if rewards is None else rewards), rec.advantages, settings)


def update_is_finite(loss: torch.Tensor | float, parameters: Iterable[torch.nn.Parameter]) -> bool:
    """False when the loss or any gradient holds a NaN or an infinity: the optimiser must then
    skip the step (zero the gradients, do not call optimizer.step()), so that one poisoned
    minibatch never reaches the weights. Call after backward(), before clipping (clipping a
    non-finite gradient spreads the NaN to every parameter)."""
    value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
    if not bool(torch.isfinite(value).all()):
        return False
    # a sharded (FSDP2) gradient is checked on this process's shard; the caller agrees with
    # the other processes
    grads = [g.to_local() if hasattr(g, "to_local") else g for p in parameters if (g := p.grad) is not None]
    if not grads:
        return True
    # one reduction per tensor, one host sync in all
    flags = torch.stack([torch.isfinite(g).all() for g in grads])
    return bool(flags.all())


def peer_groups_of(groups: Iterable[object]) -> list[tuple[str, str]]:
    """(source, prompt id) of the peer groups among a minibatch's groups (objects with
    `source` and `prompt.id`, like trainer.grpo.Group; own groups have source "self", "" or None):
    whom to report when that minibatch's update was not finite."""
    out = []
    for g in groups:
        source = getattr(g, "source", "") or ""
        if source and source != "self":
            out.append((source, g.prompt.id))  # type: ignore[attr-defined]
    return sorted(set(out))

"""Policy-gradient surrogates and their aggregation (docs/algorithm.md steps 11-12).

The paper's objective (Eq. 10), maximised:

    J = 1 / sum_j |o_j| * sum_j w_j * sum_t min(rho_t a_j, clip(rho_t, 1 - eps_low, 1 + eps_high) a_j)

with rho_t = pi_theta(o_t | .) / pi_old(o_t | .) (Eq. 9). With w = 1 everywhere it is the
GRPO/DAPO clip-higher surrogate. Each ratio variant is one function in `RATIOS` and each
aggregation one function in `AGGREGATIONS`; nothing here branches on strings in a loop.

Micro-batching: aggregation divides by a `Normalizer` computed once for the whole
minibatch, so gradient accumulation over micro-batches gives the same gradient as one
pass over the minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Normalizer:
    """Denominators of one minibatch: admitted response tokens and admitted responses."""

    tokens: float
    sequences: float
    max_response_len: int  # Dr. GRPO's constant divisor

    @staticmethod
    def of(mask: torch.Tensor, max_response_len: int) -> "Normalizer":
        """mask: (B, T) admitted response tokens of the WHOLE minibatch."""
        return Normalizer(tokens=float(mask.sum()), sequences=float((mask.sum(-1) > 0).sum()),
                          max_response_len=max_response_len)


# ----- ratios (Eq. 9) -------------------------------------------------------------------

def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho_t per token (Eq. 9). All (B, T)."""
    return (logprobs - old_logprobs) * mask


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence ratio broadcast to every token (GSPO-style ablation).

    log s_j = mean_t (log pi - log pi_old); the token's own gradient path is kept
    (log pi_t - sg(log pi_t) + sg(log s_j)) so each token still receives a gradient.
    """
    diff = (logprobs - old_logprobs) * mask  # (B, T)
    seq = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1.0)  # (B, 1)
    return (logprobs - logprobs.detach() + seq.detach()) * mask


RATIOS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}


# ----- aggregation ------------------------------------------------------------------------

def token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """sum over admitted tokens / number of admitted tokens in the minibatch (Eq. 10)."""
    return (per_token * mask).sum() / max(norm.tokens, 1.0)


def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Mean over responses of each response's token mean (original GRPO)."""
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)  # (B,)
    return per_seq.sum() / max(norm.sequences, 1.0)


def dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Token sums divided by a constant (the max response length), averaged over responses (Dr. GRPO)."""
    per_seq = (per_token * mask).sum(-1) / float(norm.max_response_len)  # (B,)
    return per_seq.sum() / max(norm.sequences, 1.0)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Normalizer], torch.Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "dr-grpo": dr_grpo,
}


# ----- the surrogate ------------------------------------------------------------------------

@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, to MINIMISE (= -J [+ kl] [- entropy bonus])
    objective: torch.Tensor  # scalar J (detached)
    clipped_low: torch.Tensor  # (B, T) bool: ratio below 1 - eps_low with a < 0 (pessimistic branch active)
    clipped_high: torch.Tensor  # (B, T) bool: ratio above 1 + eps_high with a > 0
    ratio: torch.Tensor  # (B, T) detached rho_t


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, norm: Normalizer, *, weights: torch.Tensor | None = None,
                      eps_low: float = 0.2, eps_high: float = 0.28, ratio: str = "token",
                      aggregation: str = "token-mean") -> PolicyLossOutput:
    """Weighted clipped surrogate (Eq. 9-10).

    logprobs, old_logprobs, mask: (B, T); advantages, weights: (B,) held fixed (no grad).
    `mask` is 1 on admitted response tokens; a response dropped by the gate has its whole
    row at 0, so it enters neither the numerator nor the denominator.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # (B, 1)
    w = (torch.ones_like(advantages) if weights is None else weights).detach().to(logprobs.dtype).unsqueeze(-1)
    log_rho = RATIOS[ratio](logprobs, old_logprobs.detach(), mask)  # (B, T)
    rho = torch.exp(log_rho)  # (B, T)
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = w * torch.minimum(unclipped, clipped)  # (B, T)
    objective = AGGREGATIONS[aggregation](per_token, mask, norm)
    real = mask > 0
    return PolicyLossOutput(
        loss=-objective,
        objective=objective.detach(),
        clipped_low=real & (rho < 1.0 - eps_low) & (adv < 0),
        clipped_high=real & (rho > 1.0 + eps_high) & (adv > 0),
        ratio=rho.detach(),
    )


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi. (B, T)"""
    r = ref_logprobs.detach() - logprobs
    return torch.exp(r) - r - 1.0

"""The rollout protocol every backend (transformers, vLLM) implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

from graft_fed.configbase import require


@dataclass(frozen=True)
class SamplingParams:
    #: Responses sampled per prompt (the GRPO group size).
    n: int = 8
    #: Softmax temperature. The recorded log-probs are those of the tempered distribution.
    temperature: float = 1.0
    #: Nucleus mass. Keep 1.0 during training: with top_p < 1 the recorded log-probs are
    #: those of the truncated distribution, not the model's full-vocabulary ones.
    top_p: float = 1.0
    #: Keep only the k most likely tokens (0 = off). Same caveat as top_p.
    top_k: int = 0
    #: Response length cap; a response cut here has finish_reason "length".
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        require(self.n >= 1, f"sampling n must be >= 1, got {self.n}")
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}; "
                "greedy decoding is not a sampling policy GRPO can learn from")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One sampled response.

    `token_ids` are the generating model's ids of the response (including a final EOS
    when it stopped); `logprobs[i]` is log p(token_ids[i] | prompt, token_ids[:i]) under
    the sampling distribution; `text` is the decoded response without special tokens.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def mean_logprob(self) -> float:
        return sum(self.logprobs) / max(1, len(self.logprobs))


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[list[Completion]]:
        """For each prompt text, `sampling.n` completions, in prompt order."""

    def sync_weights(self, model: Any) -> None:
        """Make the next generate() sample from `model`'s current parameters."""

    def rng_state(self) -> Any:
        """Opaque sampling RNG state, for exact resume."""

    def set_rng_state(self, state: Any) -> None:
        ...

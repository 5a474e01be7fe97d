"""The run configuration: one frozen dataclass per concern, loaded from one YAML file.

Every field is documented once, here, in its `#:` comment; docs/configuration.md is
generated from these comments (`python -m graft_fed.trainer.config --markdown`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from graft_fed.configbase import load_config, require, to_dict
from graft_fed.core.advantages import SCALES, STDS
from graft_fed.core.losses import AGGREGATIONS, RATIOS
from graft_fed.data.config import DataConfig
from graft_fed.data.templates import validate_template
from graft_fed.errors import ConfigError
from graft_fed.rewards.config import VerifierConfig
from graft_fed.rollout.base import SamplingParams


def member_seed(seed: int, name: str) -> int:
    """The sampling and initialisation seed of the co-trained model `name` in a run seeded
    `seed`: stable across processes and Python versions, different for every member."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


@dataclass(frozen=True)
class RunSection:
    """Where a run writes, how long it lasts, and how it is seeded."""

    #: Name of the run (used in logs and the default output directory).
    name: str = "grpo"
    #: Directory for metrics.jsonl, checkpoints/, eval/ and the resolved config.
    output_dir: str = "runs/grpo"
    #: This model's own seed: initialisation, sampling, minibatch shuffles (and the prompt
    #: order unless schedule_seed is set).
    seed: int = 0
    #: Seed of the prompt schedule alone (which prompts make up step r's batch). Models that
    #: exchange groups must share it (co-training members do; federation nodes use the
    #: broker's), while each samples with its own `seed`. null = `seed`.
    schedule_seed: int | None = None
    #: Number of training steps (one step = one prompt batch, rollout, update).
    steps: int = 100
    #: "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:1", ...
    device: str = "auto"
    #: Mixed precision of the forward/backward passes: "auto" (bf16 autocast on CUDA
    #: with bf16 support, fp32 elsewhere), "fp32" or "bf16". Weights and optimiser state
    #: stay fp32.
    precision: str = "auto"
    #: Save a checkpoint every this many steps (0 = only at the end).
    checkpoint_every: int = 25
    #: Keep this many most recent checkpoints (older ones are deleted; never the one just written).
    keep_checkpoints: int = 2
    #: Evaluate on `eval` prompts every this many steps (0 = only before and after).
    eval_every: int = 0
    #: Evaluate the starting model before the first step (skip it when many runs share one
    #: starting model and only the final score is needed).
    eval_before: bool = True
    #: Also write TensorBoard event files (needs the `tensorboard` extra).
    tensorboard: bool = False
    #: Torch intra-op threads (0 = torch's default).
    threads: int = 0
    #: Record every sampled group (texts, generation log-probs, rewards, advantages) to
    #: OUTPUT_DIR/trajectories.sqlite, so other models can later train against this run
    #: (GRAFT's stored mode).
    record_groups: bool = True

    def __post_init__(self) -> None:
        require(self.steps >= 1, f"run.steps must be >= 1, got {self.steps}")
        require(self.checkpoint_every >= 0, "run.checkpoint_every must be >= 0 (0 = only at the end)")
        require(self.keep_checkpoints >= 1, "run.keep_checkpoints must be >= 1")
        require(self.eval_every >= 0, "run.eval_every must be >= 0 (0 = only before and after training)")
        require(self.precision in ("auto", "fp32", "bf16"),
                f"run.precision must be auto, fp32 or bf16, got {self.precision!r}")
        require(self.threads >= 0, "run.threads must be >= 0")

    @property
    def prompt_schedule_seed(self) -> int:
        """The seed the prompt schedule uses."""
        return self.seed if self.schedule_seed is None else self.schedule_seed


@dataclass(frozen=True)
class ModelSection:
    """The policy being trained."""

    #: A local Hugging Face model directory, `zoo:<name>` for a shipped tiny model, or a
    #: hub id (downloaded by transformers on first use; never in tests).
    path: str = "zoo:tiny-llama-char"
    #: Prompt template: chat, paper, raw or a format string with {problem}
    #: (see graft_fed/data/templates.py).
    template: str = "chat"
    #: Let the tokenizer add its special tokens (e.g. BOS) when encoding a prompt. Default:
    #: false for the chat template (which writes them itself), true otherwise.
    add_special_tokens: bool | None = None

    def __post_init__(self) -> None:
        require(bool(self.path), "model.path is empty: give a model directory or zoo:<name>")
        validate_template(self.template)

    @property
    def encode_special_tokens(self) -> bool:
        return self.template != "chat" if self.add_special_tokens is None else self.add_special_tokens


@dataclass(frozen=True)
class VllmSection:
    """The vLLM rollout engine (rollout.backend: vllm; needs a CUDA GPU and
    `pip install 'graft-fed[vllm]'`). It shares the GPU with the trainer; docs/scaling.md
    says how to size it."""

    #: Fraction of the GPU's total memory the engine may take (its weights plus KV cache).
    #: It must fit in what the trainer leaves free when the engine starts.
    gpu_memory_utilization: float = 0.3
    #: GPUs one engine spans (tensor parallelism). 1: weight updates reach the engine's
    #: worker on this GPU as CUDA IPC handles; more: as CPU copies to every worker.
    tensor_parallel_size: int = 1
    #: Sleep while the trainer trains: offload the engine's weights to CPU memory and free
    #: its KV cache after each rollout (vLLM sleep mode, level 1), wake before the next.
    sleep: bool = True
    #: Engine weight dtype: "auto" (bf16 where the GPU has it, else fp16), "bf16", "fp16", "fp32".
    dtype: str = "auto"
    #: Longest prompt + response the engine accepts (null = the model's maximum).
    max_model_len: int | None = None
    #: Skip CUDA graph capture: slower decoding, faster start-up, less memory.
    enforce_eager: bool = False
    #: Log-probs vLLM records for the sampled tokens: "processed_logprobs" (after
    #: temperature / top-k / top-p, what the transformers backend records) or "raw_logprobs"
    #: (the untempered full-vocabulary model). They are equal at temperature 1, top_p 1,
    #: top_k 0; at any other temperature raw ones bias every importance ratio.
    logprobs_mode: str = "processed_logprobs"
    #: Reuse the KV cache of shared prompt prefixes (reset after every weight update).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        require(0 < self.gpu_memory_utilization <= 1,
                f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.tensor_parallel_size >= 1, "rollout.vllm.tensor_parallel_size must be >= 1")
        require(self.dtype in ("auto", "bf16", "fp16", "fp32"),
                f"rollout.vllm.dtype must be auto, bf16, fp16 or fp32, got {self.dtype!r}")
        require(self.max_model_len is None or self.max_model_len >= 1,
                "rollout.vllm.max_model_len must be >= 1 or null")
        require(self.logprobs_mode in ("raw_logprobs", "processed_logprobs"),
                f"rollout.vllm.logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}")


@dataclass(frozen=True)
class RolloutSection:
    """How responses are sampled (the behaviour policy)."""

    #: "hf" (transformers, CPU or GPU) or "vllm" (GPU only; options in rollout.vllm).
    backend: str = "hf"
    #: Responses per prompt: the GRPO group size n.
    n: int = 8
    #: Sampling temperature (the paper: 1.0).
    temperature: float = 1.0
    #: Nucleus mass. Keep 1.0 so recorded log-probs are full-vocabulary log-probs (docs/algorithm.md step 2).
    top_p: float = 1.0
    #: Top-k truncation (0 = off); same caveat as top_p.
    top_k: int = 0
    #: Response length cap in tokens.
    max_new_tokens: int = 160
    #: Sequences sampled together in one batch (hf backend; vLLM schedules its own batches).
    batch_size: int = 128
    #: Sampler randomness: "stream" (one RNG stream for the whole run, advanced by every
    #: sampled token) or "prompt" (each prompt's n responses come from streams keyed by
    #: run.seed, the batch number and the prompt's place in the batch, so the samples do not
    #: depend on rollout batching or on how prompts are split across processes). torchrun
    #: runs need "prompt".
    seeding: str = "stream"
    vllm: VllmSection = field(default_factory=VllmSection)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens)

    def __post_init__(self) -> None:
        require(self.backend in ("hf", "vllm"), f"rollout.backend must be 'hf' or 'vllm', got {self.backend!r}")
        require(self.n >= 2, f"rollout.n must be >= 2 for group-relative advantages, got {self.n}")
        try:
            self.sampling_params()  # the sampling fields' rules live in SamplingParams alone
        except ConfigError as exc:
            raise ConfigError(f"rollout.{exc}") from None
        require(self.batch_size >= 1, "rollout.batch_size must be >= 1")
        require(self.seeding in ("stream", "prompt"), f"rollout.seeding must be stream or prompt, got {self.seeding!r}")
        if self.top_p < 1 or self.top_k:
            warnings.warn("rollout.top_p < 1 or top_k > 0: the recorded behaviour log-probs are those of the "
                          "truncated distribution, so ratios and GRAFT compatibility scores are biased; "
                          "the paper trains with top_p = 1", stacklevel=2)


@dataclass(frozen=True)
class DynamicSamplingSection:
    """DAPO dynamic sampling: keep only groups with reward variance, refill from new prompts."""

    #: Turn dynamic sampling on (an optional baseline; GRAFT's point is to use all-fail
    #: groups instead of discarding them).
    enabled: bool = False
    #: At most this many extra prompt batches are sampled per step to fill the batch.
    max_extra_batches: int = 3

    def __post_init__(self) -> None:
        require(self.max_extra_batches >= 0, "algorithm.dynamic_sampling.max_extra_batches must be >= 0")


@dataclass(frozen=True)
class AlgorithmSection:
    """The GRPO update (docs/algorithm.md steps 4 and 11-13)."""

    #: Prompts per training step (the paper: 128).
    prompts_per_step: int = 16
    #: Minibatches per step, each one optimiser step (the paper: 4 of 32 prompts).
    num_minibatches: int = 4
    #: Responses per forward/backward micro-batch inside a minibatch (memory knob only:
    #: gradients are accumulated with the minibatch's normaliser, so results do not change).
    micro_batch_size: int = 64
    #: Padded tokens (rows x longest prompt + response) per micro-batch, 0 = no token cap.
    #: Responses are packed longest first until the next one would pass the budget (one
    #: longer than the budget goes alone); micro_batch_size still caps the rows. A memory
    #: knob like micro_batch_size: the gradient does not change.
    micro_batch_tokens: int = 0
    #: Optimisation epochs over the step's buffer (the paper: 1).
    epochs: int = 1
    #: Lower clip epsilon (the paper: 0.2).
    eps_low: float = 0.2
    #: Upper clip epsilon, clip-higher (the paper: 0.28).
    eps_high: float = 0.28
    #: Importance ratio: "token" (Eq. 9) or "sequence" (length-normalised, GSPO-style ablation).
    ratio: str = "token"
    #: Loss aggregation: token-mean (Eq. 10), seq-mean-token-mean, dr-grpo.
    aggregation: str = "token-mean"
    #: Divide advantages by the group std ("group") or not ("none", Dr. GRPO).
    scale_rewards: str = "group"
    #: Std of the advantage: "sample" (n-1, verl/torch default, as the paper) or
    #: "population" (n; a documented deviation).
    std: str = "sample"
    #: Exclude responses cut at max_new_tokens from the loss.
    mask_truncated: bool = False
    #: Coefficient of a k3 KL penalty to the initial policy (the paper: 0, off).
    kl_coef: float = 0.0
    #: Coefficient of an entropy bonus (the paper: 0, off).
    entropy_coef: float = 0.0
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)

    def __post_init__(self) -> None:
        require(self.prompts_per_step >= 1, "algorithm.prompts_per_step must be >= 1")
        require(self.num_minibatches >= 1, "algorithm.num_minibatches must be >= 1")
        require(self.prompts_per_step % self.num_minibatches == 0,
                f"algorithm.prompts_per_step ({self.prompts_per_step}) must be divisible by "
                f"algorithm.num_minibatches ({self.num_minibatches}) so every minibatch holds whole groups")
        require(self.micro_batch_size >= 1, "algorithm.micro_batch_size must be >= 1")
        require(self.micro_batch_tokens >= 0, "algorithm.micro_batch_tokens must be >= 0 (0 = no token cap)")
        require(self.epochs >= 1, "algorithm.epochs must be >= 1")
        require(0 <= self.eps_low < 1, f"algorithm.eps_low must be in [0, 1), got {self.eps_low}")
        require(self.eps_high >= 0, f"algorithm.eps_high must be >= 0, got {self.eps_high}")
        require(self.ratio in RATIOS, f"algorithm.ratio must be one of {sorted(RATIOS)}, got {self.ratio!r}")
        require(self.aggregation in AGGREGATIONS,
                f"algorithm.aggregation must be one of {sorted(AGGREGATIONS)}, got {self.aggregation!r}")
        require(self.scale_rewards in SCALES,
                f"algorithm.scale_rewards must be one of {list(SCALES)}, got {self.scale_rewards!r}")
        require(self.std in STDS, f"algorithm.std must be one of {list(STDS)}, got {self.std!r}")
        require(self.kl_coef >= 0, "algorithm.kl_coef must be >= 0")
        require(self.entropy_coef >= 0, "algorithm.entropy_coef must be >= 0")


@dataclass(frozen=True)
class OptimSection:
    """AdamW and its schedule (the paper: lr 1e-6 constant, betas 0.9/0.999, wd 0.01, clip 1.0)."""

    #: Peak learning rate.
    lr: float = 1e-6
    #: AdamW betas.
    betas: tuple[float, float] = (0.9, 0.999)
    #: AdamW epsilon.
    eps: float = 1e-8
    #: Decoupled weight decay.
    weight_decay: float = 0.01
    #: Global gradient-norm clip (0 = off).
    grad_clip: float = 1.0
    #: "constant", "linear" (decay to min_lr_ratio) or "cosine".
    schedule: str = "constant"
    #: Linear warm-up, in training steps.
    warmup_steps: int = 0
    #: Final lr as a fraction of lr, for linear and cosine.
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        require(all(0 <= b < 1 for b in self.betas), f"optim.betas must be in [0, 1), got {self.betas}")
        require(self.weight_decay >= 0, "optim.weight_decay must be >= 0")
        require(self.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 = off)")
        require(self.schedule in ("constant", "linear", "cosine"),
                f"optim.schedule must be constant, linear or cosine, got {self.schedule!r}")
        require(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]")


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation: pass@1 as the mean over k samples (the paper: T 0.6, top_p 0.95, k 8)."""

    data: DataConfig = field(default_factory=lambda: DataConfig(split="validation"))
    #: Samples per prompt.
    k: int = 8
    temperature: float = 0.6
    top_p: float = 0.95
    #: Response length cap; null = rollout.max_new_tokens.
    max_new_tokens: int | None = None
    #: Seed of the evaluation sampler (kept apart from training randomness).
    seed: int = 1234
    #: "stream": one sampler stream for the whole evaluation (a response depends on the batch
    #: it is sampled in). "prompt": response j of a prompt draws from a stream keyed by (seed,
    #: prompt id, j) alone, so the result does not depend on batch size or order, and two
    #: models are scored on the same random numbers prompt by prompt (common random numbers:
    #: a difference between two runs loses most of the evaluation's sampling noise).
    seeding: str = "stream"

    def __post_init__(self) -> None:
        require(self.k >= 1, "eval.k must be >= 1")
        require(self.seeding in ("stream", "prompt"), f"eval.seeding must be stream or prompt, got {self.seeding!r}")
        require(self.temperature > 0, "eval.temperature must be > 0")
        require(0 < self.top_p <= 1, "eval.top_p must be in (0, 1]")


@dataclass(frozen=True)
class GraftSection:
    """GRAFT's exchange (docs/algorithm.md steps 1-13 and "Stored peers"). Every ablation of the paper is one switch here
    (plus algorithm.ratio for the sequence-level ratio and rollout.n for larger-n GRPO)."""

    #: Compatibility floor delta of Eq. 8: peer responses with s <= delta are dropped (paper: 0.8).
    delta: float = 0.8
    #: Apply the gate of Eq. 8; false = every peer response gets w = 1 ("no gate" ablation).
    gate: bool = True
    #: "pairwise": the paper's balancing, m = min(|C_AB|, |C_BA|) with ties; "none": every
    #: candidate in each direction ("no balancing" ablation; always so in stored mode).
    balance: str = "pairwise"
    #: Minibatch order: "peer_last" (paper), "peer_first" or "shuffled" (ablations).
    order: str = "peer_last"
    #: What moves: "group" (the source's whole group, paper), "success_only" or "pooled" (ablations).
    transfer: str = "group"
    #: Re-verify every peer response with this model's verifier; a group whose claimed rewards
    #: disagree is rejected (never trained on) and counted. Off only for debugging.
    reverify: bool = True
    #: Stored mode: the trajectories.sqlite of a peer run to learn from (null = off). The
    #: run must have normalised its advantages as this one does (algorithm.scale_rewards/std).
    peer_store: str | None = None
    #: Which run in the store to use when it holds several (null = the only one).
    peer_run: str | None = None
    #: Which stored group serves a prompt: "same_step" (the paper's same prompt schedule),
    #: "latest_before" (freshest at a step <= this one) or "latest".
    store_match: str = "same_step"
    #: With several peers, which one serves a prompt: "compatibility" (the method:
    #: core.exchange.source_rank) or "random" (ablation: one peer drawn uniformly per prompt,
    #: keyed by the schedule seed, step, receiver and prompt; the prompt moves only if that peer
    #: has an informative group for it, as swarm systems that share with random peers).
    source_choice: str = "compatibility"
    #: The most tokens (this model's own) of one peer response this receiver trains on; a peer
    #: group with a longer response is refused (graft/rejected_too_long) and reported as
    #: unusable. 0 = 4 x rollout.max_new_tokens. Never more than the model's context takes.
    max_peer_tokens: int = 0

    def __post_init__(self) -> None:
        require(0 <= self.delta < 1, f"graft.delta must be in [0, 1), got {self.delta}")
        require(isinstance(self.max_peer_tokens, int) and not isinstance(self.max_peer_tokens, bool)
                and self.max_peer_tokens >= 0,
                f"graft.max_peer_tokens must be a whole number of tokens >= 0 (0 = 4 x rollout.max_new_tokens), "
                f"got {self.max_peer_tokens!r}")
        require(self.balance in ("pairwise", "none"), "graft.balance must be 'pairwise' or 'none'")
        require(self.order in ("peer_last", "peer_first", "shuffled"),
                "graft.order must be peer_last, peer_first or shuffled")
        require(self.transfer in ("group", "success_only", "pooled"),
                "graft.transfer must be group, success_only or pooled")
        require(self.store_match in ("same_step", "latest_before", "latest"),
                "graft.store_match must be same_step, latest_before or latest")
        require(self.source_choice in ("compatibility", "random"),
                "graft.source_choice must be compatibility or random")


@dataclass(frozen=True)
class DistributedSection:
    """One model trained by several processes (`torchrun --nproc-per-node K -m graft_fed.cli
    train ...`): FSDP2 shards parameters, gradients and optimiser state across them.
    A plain single-process run ignores this section; none of it changes results."""

    #: Recompute each transformer block's activations during the backward pass instead of
    #: keeping them (less memory, about one extra forward pass of compute).
    activation_checkpointing: bool = False
    #: Free each block's gathered parameters right after its forward pass (least memory);
    #: false keeps them gathered until the backward pass (one all-gather less per block).
    reshard_after_forward: bool = True
    #: Collective backend: "auto" (nccl on CUDA, gloo on CPU), "nccl" or "gloo".
    backend: str = "auto"
    #: Seconds a process waits in a collective for the others before the run fails.
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        require(self.backend in ("auto", "nccl", "gloo"),
                f"distributed.backend must be auto, nccl or gloo, got {self.backend!r}")
        require(self.timeout_s >= 1, "distributed.timeout_s must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    """One training run of one model."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    eval: EvalSection = field(default_factory=EvalSection)
    graft: GraftSection = field(default_factory=GraftSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def __post_init__(self) -> None:
        if self.algorithm.num_minibatches * self.algorithm.epochs == 1:
            warnings.warn("one minibatch and one epoch per step: every ratio is exactly 1, so clipping is "
                          "inert and GRAFT's peer-last ordering has no effect; use >= 2 minibatches",
                          stacklevel=2)

    # Fields that may change between a run and its resumption without changing its results.
    _RESUME_FREE = {("run", "steps"), ("run", "output_dir"), ("run", "checkpoint_every"),
                    ("run", "keep_checkpoints"), ("run", "eval_every"), ("run", "tensorboard"),
                    ("run", "threads"), ("run", "name"), ("run", "device"), ("run", "record_groups"), ("run", "eval_before"), ("eval",),
                    ("verifier", "workers"), ("verifier", "timeout_s"), ("rollout", "batch_size"),
                    ("algorithm", "micro_batch_size"), ("rollout", "vllm", "gpu_memory_utilization"),
                    ("rollout", "vllm", "enforce_eager"), ("rollout", "vllm", "sleep"),
                    ("algorithm", "micro_batch_tokens"), ("distributed",)}

    def fingerprint_dict(self) -> dict[str, Any]:
        d = to_dict(self)
        for key in self._RESUME_FREE:
            node = d
            for part in key[:-1]:
                node = node[part]
            node.pop(key[-1], None)
        if self.rollout.backend != "vllm":
            d["rollout"].pop("vllm", None)  # unused: keeps earlier hf runs' fingerprints
        for key, default in (("answer_format", "plain"), ("dataset_id", None)):
            if d["data"].get(key, default) == default:
                d["data"].pop(key, None)  # the defaults keep earlier runs' fingerprints
        if self.rollout.seeding == "stream":
            d["rollout"].pop("seeding")  # the default: keeps earlier runs' fingerprints
        if self.run.schedule_seed is None:
            d["run"].pop("schedule_seed")  # the default: keeps earlier runs' fingerprints
        if not self.graft.max_peer_tokens:
            d["graft"].pop("max_peer_tokens")  # the default: keeps earlier runs' fingerprints
        return d

    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **sections: Any) -> "TrainConfig":
        return dataclasses.replace(self, **sections)


def load_train_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Read a YAML run config (or the defaults), apply dotted `overrides`, validate."""
    return load_config(TrainConfig, path, overrides, "config")

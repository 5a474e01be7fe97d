"""Model loading and the teacher-forced forward pass shared by rollout, training and scoring.

Layout convention for a batch of (prompt, response) pairs, used everywhere so that the
log-probs recorded at sampling time and those recomputed for training are computed on
identical inputs:

    [pad ... pad | prompt tokens | response tokens | pad ... pad]
     left-padded to the longest prompt, responses right-padded to the longest response.

Position ids count real tokens only (cumsum of the attention mask - 1), so models with
absolute position embeddings (GPT-2) see the same positions whatever the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from graft_fed.errors import ConfigError


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, P + R) long
    attention_mask: torch.Tensor  # (B, P + R) long
    position_ids: torch.Tensor  # (B, P + R) long
    response_mask: torch.Tensor  # (B, R) float: 1 on real response tokens
    prompt_len: int  # P: the response starts at column P


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
         device: torch.device | str = "cpu") -> PackedBatch:
    """Pack token-id lists into the layout described in the module docstring."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    batch = len(prompts)
    p_len = max((len(p) for p in prompts), default=0)
    r_len = max(1, max((len(r) for r in responses), default=0))
    ids = torch.full((batch, p_len + r_len), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, p_len + r_len), dtype=torch.long)
    resp_mask = torch.zeros((batch, r_len), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p):
            ids[i, p_len - len(p):p_len] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, p_len - len(p):p_len] = 1
        if len(r):
            ids[i, p_len:p_len + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, p_len:p_len + len(r)] = 1
            resp_mask[i, :len(r)] = 1.0
    return PackedBatch(ids.to(device), mask.to(device), position_ids_from_mask(mask).to(device),
                       resp_mask.to(device), p_len)


@dataclass
class ResponseForward:
    logprobs: torch.Tensor  # (B, R) log pi(token | prefix) at the given temperature
    entropy: torch.Tensor | None  # (B, R) entropy of the token distribution, if asked


def response_forward(model: Any, batch: PackedBatch, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = False) -> ResponseForward:
    """Teacher-forced log-probs of the response tokens under `model` (grad flows if enabled).

    The entropy (`with_entropy`) keeps its graph only with `entropy_grad` (an entropy bonus
    in the loss); as a metric it is computed without one, so that the graph holds one
    (B, R, V) float32 tensor (the log-softmax) rather than two: 0.6 MB per response token
    with a 152k vocabulary, through the whole backward pass."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    r_len = batch.response_mask.shape[1]
    # Logits at column t predict token t+1: the response tokens are predicted by
    # columns P-1 .. P+R-2.
    logits = out.logits[:, batch.prompt_len - 1:batch.prompt_len - 1 + r_len, :].float()  # (B, R, V)
    del out  # the full-sequence logits (prompt columns too) are not needed past the slice
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # (B, R, V)
    del logits  # the graph keeps the log-softmax, not its input
    targets = batch.input_ids[:, batch.prompt_len:batch.prompt_len + r_len]  # (B, R)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, R)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, R)
    return ResponseForward(logprobs=logprobs, entropy=entropy)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ConfigError(f"unknown dtype {name!r}; use one of auto, fp32, bf16, fp16")
    return table[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but no CUDA device is available; use 'cpu' or 'auto'")
    return device


def check_model_source(spec: str, path: str) -> None:
    """Say in one line why a model cannot be loaded, before transformers does it with a
    traceback (or after a minute of retries): a missing directory, a malformed hub id, a hub
    id that is neither cached nor reachable."""
    if Path(path).exists():
        return
    parts = path.split("/")
    if path.startswith(("/", ".", "~")) or "\\" in path or len(parts) != 2 or not all(parts):
        if len(parts) == 1 and not path.startswith(("/", ".", "~")):
            raise ConfigError(f"model {spec!r} is neither a local directory nor zoo:<name> nor a hub id "
                              "(namespace/name)")
        raise ConfigError(f"model {spec!r}: the directory {path} does not exist")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return  # in the local hub cache: loads without the network
    except Exception:  # noqa: BLE001 - an unusual cache layout: let transformers decide
        return
    import os

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ConfigError(f"model {spec!r}: not a local directory and not in the hub cache, and HF_HUB_OFFLINE is "
                          "set; download it where the hub is reachable and set model.path to its directory")
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        HfApi().model_info(path, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ConfigError(f"model {spec!r}: no such model on the Hugging Face hub, or it needs a token "
                          f"({type(exc).__name__}); for a local model give its directory") from None
    except Exception as exc:  # noqa: BLE001 - any network failure: unreachable
        raise ConfigError(f"model {spec!r}: not a local directory, not in the hub cache, and the Hugging Face hub "
                          f"cannot be reached ({type(exc).__name__}: {str(exc)[:120]}); download it where the hub "
                          "is reachable (`hf download ID --local-dir DIR`) and set model.path to DIR") from None


def load_model_and_tokenizer(spec: str, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a local path or `zoo:<name>`; never downloads
    unless `spec` is a hub id and the environment allows it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_fed.zoo import resolve_model_path

    path = resolve_model_path(spec)
    check_model_source(spec, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {spec!r}: cannot load its tokenizer from {path}: {exc}") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"tokenizer of {spec!r} has neither a pad nor an eos token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {spec!r}: cannot load it from {path}: {exc}") from None
    model.to(device)
    return model, tokenizer


def eos_token_ids(tokenizer: Any, model: Any | None = None) -> list[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None) if model is not None else None
    extra = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(x) for x in extra)
    return sorted(ids)


def tokenizer_id(tokenizer: Any) -> str:
    """A short fingerprint of a tokenizer's vocabulary: equal ids mean equal tokenisations."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(repr(vocab).encode()).hexdigest()[:12]
    return f"{type(tokenizer).__name__}:{len(vocab)}:{digest}"

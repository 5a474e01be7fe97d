"""Transformers rollout backend: batched, left-padded, KV-cached sampling on CPU or GPU.

It samples with its own loop rather than `model.generate` so that the log-prob it
records for each token is exactly the one of the distribution it sampled from
(temperature, then top-k, then top-p), computed in float32, and so that positions
follow the project's packing convention (graft_fed.modeling).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Any, Sequence

import torch

from graft_fed.modeling import eos_token_ids, position_ids_from_mask
from graft_fed.rollout.base import Completion, SamplingParams

log = logging.getLogger(__name__)

_CPU_STATE_BYTES = 5056  # torch.Generator('cpu').get_state(): the Mersenne Twister's state
_CUDA_STATE_BYTES = 16  # a CUDA generator's: its Philox seed and offset


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k / nucleus. logits: (B, V) float32."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token is always kept.
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def stream_seed(*key: int) -> int:
    """A 63-bit seed from integers (run seed, batch number, position, response ...): the
    same key gives the same seed on every machine and Python version."""
    digest = hashlib.sha256(":".join(str(int(k)) for k in key).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def keyed_uniforms(seed: int, count: int) -> torch.Tensor:
    """`count` uniforms in [0, 1) (float64) from the stream `seed`: one per token position."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.rand(count, generator=gen, dtype=torch.float64)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse transform sampling. probs: (B, V); uniforms: (B,) in [0, 1).

    A row's draw depends on its own uniform and distribution only, never on the other rows
    of the batch (unlike torch.multinomial with a shared generator)."""
    cdf = probs.double().cumsum(-1)  # (B, V)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    # The first token whose cumulative mass exceeds the target has positive probability;
    # a target rounded up to the total mass falls back to the last token that has some.
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # (B,)
    return torch.minimum(drawn, last)


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the KV cache `cache`; earlier releases `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFRollout:
    """Rollout engine over a transformers causal LM that it shares with the trainer."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64,
                 seed: int = 0, add_special_tokens: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.add_special_tokens = add_special_tokens
        self.device = next(model.parameters()).device
        # The stream lives where the model does: sampling a (B, V) distribution on the CPU
        # would copy it off the GPU and draw on one core at every token (0.4 s a token for
        # 128 responses over a 152k vocabulary, measured; bench/gpu_check.py).
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    # The trainer updates the very module this engine samples from.
    def sync_weights(self, model: Any) -> None:
        self.model = model

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Resume the stream. A state of the other kind of generator (a CPU one's, which
        every checkpoint before the sampler moved to the model's device holds, resumed on a
        GPU; a CUDA one's resumed on a CPU) cannot continue that stream: the engine then
        reseeds from the state's bytes, so the resumed run is still reproducible (on the same
        kind of GPU: CUDA's draws depend on its launch grid), and says so.
        A state of any other size is not a generator's: ValueError (a checkpoint error)."""
        state = torch.as_tensor(state, dtype=torch.uint8).cpu()
        own = self.generator.get_state().numel()
        if state.numel() != own:
            kind = {_CPU_STATE_BYTES: "CPU", _CUDA_STATE_BYTES: "CUDA"}.get(state.numel())
            if kind is None:
                raise ValueError(f"the rollout RNG state has {state.numel()} bytes, which is no generator's "
                                 f"(a CPU one has {_CPU_STATE_BYTES}, a CUDA one {_CUDA_STATE_BYTES})")
            seed = stream_seed(*state.tolist())
            log.warning("the rollout RNG state is a %s generator's and this engine samples on %s: the sampling "
                        "stream is reseeded from it (seed %d), so samples after this resume differ from those "
                        "the original run would have drawn", kind, self.device, seed)
            self.generator.manual_seed(seed)
            return
        self.generator.set_state(state)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=self.add_special_tokens)["input_ids"])

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[list[Completion]]:
        """`seeds` (one per prompt) switches to keyed sampling: response j of prompt i draws
        its tokens from the stream stream_seed(seeds[i], j) alone, whatever batch it is
        sampled in; without it every token advances the engine's one generator."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(sampling.n)]
        keys = [stream_seed(seeds[i], j) for i in range(len(prompts)) for j in range(sampling.n)] if seeds is not None else None
        out: list[list[Completion]] = [[] for _ in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(flat), self.batch_size):
                chunk = flat[start:start + self.batch_size]
                uniforms = None
                if keys is not None:
                    uniforms = torch.stack([keyed_uniforms(k, sampling.max_new_tokens)
                                            for k in keys[start:start + self.batch_size]])  # (b, max_new_tokens)
                for (i, _), comp in zip(chunk, self._sample_batch([ids for _, ids in chunk], sampling, uniforms)):
                    out[i].append(comp)
        finally:
            self.model.train(was_training)
        return out

    def _sample_batch(self, prompt_ids: list[list[int]], sp: SamplingParams,
                      uniforms: torch.Tensor | None = None) -> list[Completion]:
        batch = len(prompt_ids)
        p_len = max(len(p) for p in prompt_ids)
        ids = torch.full((batch, p_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, p_len), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, p_len - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[i, p_len - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        eos = torch.as_tensor(self.eos_ids, dtype=torch.long, device=self.device)

        tokens = torch.full((batch, sp.max_new_tokens), self.pad_id, dtype=torch.long)
        logps = torch.zeros((batch, sp.max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(batch, dtype=torch.long)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool)

        cache_kw = _cache_kwarg(self.model)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                         use_cache=True)
        past = getattr(out, cache_kw)
        next_pos = mask.sum(-1, keepdim=True)  # (B, 1): position of the next token
        logits = out.logits[:, -1, :]
        for step in range(sp.max_new_tokens):
            scaled = logits.float() / sp.temperature  # (B, V)
            scaled = filter_logits(scaled, sp.top_k, sp.top_p)
            logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
            if uniforms is None:
                sampled_dev = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)  # (B,)
            else:
                sampled_dev = inverse_cdf_sample(logp.exp(), uniforms[:, step])  # (B,)
            sampled = sampled_dev.cpu()
            tok_logp = logp.gather(-1, sampled_dev.unsqueeze(-1)).squeeze(-1).cpu()
            live = ~done.cpu()
            tokens[live, step] = sampled[live]
            logps[live, step] = tok_logp[live]
            lengths[live] += 1
            hit_eos = torch.isin(sampled_dev, eos) & ~done
            stopped |= hit_eos.cpu()
            done |= hit_eos
            if bool(done.all()):
                break
            feed = torch.where(done, torch.full_like(sampled_dev, self.pad_id), sampled_dev)
            mask = torch.cat([mask, (~done).long().unsqueeze(-1)], dim=-1)
            out = self.model(input_ids=feed.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{cache_kw: past})
            past = getattr(out, cache_kw)
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :]

        results = []
        for i in range(batch):
            n_tok = int(lengths[i])
            tok_list = tokens[i, :n_tok].tolist()
            results.append(Completion(
                text=self.tokenizer.decode(tok_list, skip_special_tokens=True),
                token_ids=tok_list,
                logprobs=logps[i, :n_tok].tolist(),
                finish_reason="stop" if bool(stopped[i]) else "length",
                prompt_token_ids=list(prompt_ids[i]),
            ))
        return results

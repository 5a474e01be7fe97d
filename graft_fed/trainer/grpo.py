"""The per-model training loop: sample -> verify -> advantages -> update -> checkpoint.

GRAFT.md section 1 steps 1-4 and 11-14 with no peer. The step is split into phases
(`collect`, `build_buffer`, `optimise`) so that GRAFT can insert peer groups between
collection and optimisation without touching either.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from graft_fed.configbase import to_dict
from graft_fed.core.advantages import group_advantages, successes
from graft_fed.core.losses import AGGREGATIONS, Normalizer, clipped_surrogate, k3_kl
from graft_fed.data.config import load_prompts
from graft_fed.data.prompts import Prompt
from graft_fed.data.templates import render_prompt
from graft_fed.errors import CheckpointError
from graft_fed.evaluation import EvalResult, evaluate, write_eval
from graft_fed.modeling import load_model_and_tokenizer, pack, resolve_device, response_forward
from graft_fed.rewards import build_verifier
from graft_fed.rollout.base import Completion, SamplingParams
from graft_fed.rollout.hf import HFRollout
from graft_fed.trainer import checkpoint as ckpt
from graft_fed.trainer.config import TrainConfig
from graft_fed.trainer.metrics import MetricsWriter
from graft_fed.trainer.schedule import PromptSchedule

log = logging.getLogger("graft_fed.trainer")


@dataclass
class Group:
    """One prompt's group of n responses, as the receiver will train on it."""

    prompt: Prompt
    prompt_ids: list[int]  # the TRAINED model's tokenisation of its rendered prompt
    completions: list[Completion]
    rewards: torch.Tensor  # (n,)
    advantages: torch.Tensor  # (n,)
    weights: torch.Tensor | None = None  # (n,) GRAFT compatibility weights; None = all 1
    source: str = "self"  # who generated it

    @property
    def k(self) -> int:
        return int(successes(self.rewards.unsqueeze(0))[0])

    @property
    def n(self) -> int:
        return len(self.completions)


@dataclass
class StepData:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def _numpy_state_to_plain(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)


class GRPOTrainer:
    """Trains one model with GRPO; GRAFT subclasses/extends it by adding peer groups."""

    def __init__(self, cfg: TrainConfig, resume: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.out_dir = Path(cfg.run.output_dir)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = resolve_device(cfg.run.device)
        self.autocast = (cfg.run.precision == "bf16" or
                         (cfg.run.precision == "auto" and self.device.type == "cuda"
                          and torch.cuda.is_bf16_supported()))
        self._seed_everything(cfg.run.seed)

        resume_dir = self._find_resume(resume)
        manifest = ckpt.verify_checkpoint(resume_dir, cfg.fingerprint()) if resume_dir else None
        model_spec = str(resume_dir / "model") if resume_dir else cfg.model.path
        self.model, self.tokenizer = load_model_and_tokenizer(model_spec, self.device)
        # RL updates run without dropout: the ratio's denominator must be reproducible.
        self.model.eval()
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            ref_spec = cfg.model.path
            self.ref_model, _ = load_model_and_tokenizer(ref_spec, self.device)
            self.ref_model.eval().requires_grad_(False)

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.schedule, o.warmup_steps, cfg.run.steps, o.min_lr_ratio))
        self.engine = HFRollout(self.model, self.tokenizer, batch_size=cfg.rollout.batch_size,
                                seed=cfg.run.seed, add_special_tokens=cfg.model.encode_special_tokens)
        self.sampling = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                       top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
        self.verifier = build_verifier(cfg.verifier)
        self.schedule = PromptSchedule(load_prompts(cfg.data), cfg.algorithm.prompts_per_step, cfg.run.seed)
        self.step = 0
        if resume_dir is not None:
            self._restore(resume_dir, manifest)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2), encoding="utf-8")
        self.metrics = MetricsWriter(self.out_dir, tensorboard=cfg.run.tensorboard,
                                     resume_step=self.step if resume_dir else 0)

    # ----- setup helpers ---------------------------------------------------------------

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def _find_resume(self, resume: str | None) -> Path | None:
        if resume is None:
            return None
        if resume == "auto":
            found = ckpt.latest_checkpoint(self.out_dir / "checkpoints")
            if found is None:
                log.info("no checkpoint under %s: starting from scratch", self.out_dir / "checkpoints")
            return found
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
        return path

    def close(self) -> None:
        self.metrics.close()
        self.verifier.close()

    def __enter__(self) -> "GRPOTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- checkpointing -----------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "schedule_cursor": self.schedule.cursor,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": _numpy_state_to_plain(np.random.get_state()),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "rollout": self.engine.rng_state(),
            },
        }

    def save_checkpoint(self) -> Path:
        return ckpt.save_checkpoint(self.out_dir / "checkpoints", self.step, self.model, self.tokenizer,
                                    self._trainer_state(), self.cfg.fingerprint(), self.cfg.run.keep_checkpoints)

    def _restore(self, path: Path, manifest: dict[str, Any] | None) -> None:
        state = ckpt.load_trainer_state(path)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.schedule.cursor = int(state["schedule_cursor"])
            rng = state["rng"]
            random.setstate(rng["python"])
            np.random.set_state(_numpy_state_from_plain(rng["numpy"]))
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            self.engine.set_rng_state(rng["rollout"])
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {exc}") from None
        if manifest is not None and manifest["step"] != self.step:
            raise CheckpointError(f"checkpoint {path}: manifest step {manifest['step']} != state step {self.step}")
        log.info("resumed from %s at step %d", path, self.step)

    # ----- one step --------------------------------------------------------------------------

    def render(self, problem: str) -> str:
        return render_prompt(problem, self.cfg.model.template, self.tokenizer)

    def make_groups(self, prompts: Sequence[Prompt], completions: Sequence[Sequence[Completion]],
                    rewards: Sequence[float]) -> list[Group]:
        n = self.sampling.n
        r = torch.tensor(rewards, dtype=torch.float32).view(len(prompts), n)  # (G, n)
        adv = group_advantages(r, scale=self.cfg.algorithm.scale_rewards, std=self.cfg.algorithm.std)  # (G, n)
        return [Group(prompt=p, prompt_ids=list(c[0].prompt_token_ids), completions=list(c),
                      rewards=r[i], advantages=adv[i]) for i, (p, c) in enumerate(zip(prompts, completions))]

    def collect(self) -> StepData:
        """Sample and verify this step's own groups (with DAPO refills when enabled)."""
        t0 = time.perf_counter()
        t_rollout = t_verify = 0.0
        ds = self.cfg.algorithm.dynamic_sampling
        groups: list[Group] = []
        timeouts = errors = gen_tokens = 0
        sampled_groups: list[Group] = []
        for attempt in range(1 + (ds.max_extra_batches if ds.enabled else 0)):
            prompts = self.schedule.next_batch()
            ta = time.perf_counter()
            completions = self.engine.generate([self.render(p.problem) for p in prompts], self.sampling)
            tb = time.perf_counter()
            scored = self.verifier.score([c.text for g in completions for c in g],
                                         [p.answer for p, g in zip(prompts, completions) for _ in g])
            tc = time.perf_counter()
            t_rollout += tb - ta
            t_verify += tc - tb
            timeouts += scored.timeouts
            errors += scored.errors
            gen_tokens += sum(len(c.token_ids) for g in completions for c in g)
            new = self.make_groups(prompts, completions, scored.rewards)
            sampled_groups.extend(new)
            if not ds.enabled:
                groups = new
                break
            groups.extend(g for g in new if 0 < g.k < g.n)
            if len(groups) >= self.cfg.algorithm.prompts_per_step:
                break
        if ds.enabled:
            groups = groups[:self.cfg.algorithm.prompts_per_step]
        m = self.group_metrics(sampled_groups)
        m.update({
            "time/rollout": t_rollout, "time/verify": t_verify,
            "tokens_per_second/rollout": gen_tokens / max(t_rollout, 1e-9),
            "verifier/timeouts": float(timeouts), "verifier/errors": float(errors),
            "dynamic_sampling/kept_groups": float(len(groups)) if ds.enabled else float("nan"),
            "time/collect": time.perf_counter() - t0,
        })
        return StepData(groups=groups, metrics=m)

    @staticmethod
    def group_metrics(groups: Sequence[Group]) -> dict[str, float]:
        rewards = torch.stack([g.rewards for g in groups])  # (G, n)
        ks = successes(rewards)
        n = rewards.shape[1]
        lengths = torch.tensor([len(c.token_ids) for g in groups for c in g.completions], dtype=torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for g in groups for c in g.completions],
                                 dtype=torch.float32)
        return {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std(dim=1).mean().item(),
            "accuracy": (rewards > 0.5).float().mean().item(),
            "frac_reward_zero_std": (rewards.std(dim=1) == 0).float().mean().item(),
            "frac_all_fail": (ks == 0).float().mean().item(),
            "frac_all_pass": (ks == n).float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
        }

    def buffer_order(self, groups: Sequence[Group]) -> list[list[Group]]:
        """Split the step's groups into minibatches (GRAFT overrides this with peer-last)."""
        chunks = np.array_split(np.arange(len(groups)), self.cfg.algorithm.num_minibatches)
        return [[groups[i] for i in chunk] for chunk in chunks if len(chunk)]

    def _flatten(self, groups: Sequence[Group]) -> dict[str, Any]:
        prompt_ids, resp_ids, adv, weights, keep = [], [], [], [], []
        mask_trunc = self.cfg.algorithm.mask_truncated
        for g in groups:
            w = g.weights if g.weights is not None else torch.ones(g.n)
            for c, a, wi in zip(g.completions, g.advantages.tolist(), w.tolist()):
                prompt_ids.append(g.prompt_ids)
                resp_ids.append(c.token_ids)
                adv.append(a)
                weights.append(wi)
                # A weight of exactly 0 is the GRAFT gate dropping the response (Eq. 8):
                # it leaves numerator AND denominator.
                keep.append(0.0 if (wi == 0.0 or (mask_trunc and c.finish_reason == "length")) else 1.0)
        return {"prompt_ids": prompt_ids, "resp_ids": resp_ids, "adv": torch.tensor(adv),
                "weights": torch.tensor(weights), "keep": torch.tensor(keep)}

    def _micro_batches(self, flat: dict[str, Any]) -> list[tuple[slice, Any]]:
        size = self.cfg.algorithm.micro_batch_size
        n = len(flat["resp_ids"])
        out = []
        for s in range(0, n, size):
            sl = slice(s, min(n, s + size))
            batch = pack(flat["prompt_ids"][sl], flat["resp_ids"][sl], self.tokenizer.pad_token_id, self.device)
            batch.response_mask = batch.response_mask * flat["keep"][sl].to(self.device).unsqueeze(-1)
            out.append((sl, batch))
        return out

    def _forward(self, model: Any, batch: Any, with_entropy: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return response_forward(model, batch, temperature=self.sampling.temperature, with_entropy=with_entropy)

    @torch.no_grad()
    def old_logprobs(self, micro: list[tuple[slice, Any]]) -> list[torch.Tensor]:
        """log pi_old on the trained model's tokenisation, before any update of this step (Eq. 9's
        denominator, for own and peer responses alike)."""
        return [self._forward(self.model, batch).logprobs.detach() for _, batch in micro]

    def optimise(self, groups: Sequence[Group]) -> dict[str, float]:
        a = self.cfg.algorithm
        t0 = time.perf_counter()
        minibatches = self.buffer_order(groups)
        prepared = []
        for mb in minibatches:
            flat = self._flatten(mb)
            micro = self._micro_batches(flat)
            old = self.old_logprobs(micro)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = [self._forward(self.ref_model, b).logprobs for _, b in micro]
            prepared.append((flat, micro, old, ref))
        agg = AGGREGATIONS[a.aggregation]
        stats = {"tokens": 0.0, "low": 0.0, "high": 0.0, "entropy": 0.0, "kl": 0.0, "loss": 0.0}
        grad_norms = []
        for _epoch in range(a.epochs):
            for flat, micro, old, ref in prepared:
                mask_all = torch.cat([torch.nn.functional.pad(b.response_mask, (0, self.sampling.max_new_tokens
                                                                                 - b.response_mask.shape[1]))
                                      for _, b in micro])
                norm = Normalizer.of(mask_all, self.sampling.max_new_tokens)
                self.optimizer.zero_grad(set_to_none=True)
                for j, (sl, batch) in enumerate(micro):
                    fwd = self._forward(self.model, batch, with_entropy=True)
                    out = clipped_surrogate(
                        fwd.logprobs, old[j], flat["adv"][sl].to(self.device), batch.response_mask, norm,
                        weights=flat["weights"][sl].to(self.device), eps_low=a.eps_low, eps_high=a.eps_high,
                        ratio=a.ratio, aggregation=a.aggregation)
                    loss = out.loss
                    if ref is not None:
                        kl_tok = k3_kl(fwd.logprobs, ref[j])
                        loss = loss + a.kl_coef * agg(kl_tok, batch.response_mask, norm)
                        stats["kl"] += float((kl_tok * batch.response_mask).sum())
                    if a.entropy_coef > 0:
                        loss = loss - a.entropy_coef * agg(fwd.entropy, batch.response_mask, norm)
                    loss.backward()
                    m = batch.response_mask
                    stats["tokens"] += float(m.sum())
                    stats["low"] += float(out.clipped_low.sum())
                    stats["high"] += float(out.clipped_high.sum())
                    stats["entropy"] += float((fwd.entropy.detach() * m).sum())
                    stats["loss"] += float(loss.detach())
                clip = self.cfg.optim.grad_clip
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
                grad_norms.append(float(gn))
                self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.engine.sync_weights(self.model)
        tokens = max(stats["tokens"], 1.0)
        metrics = {
            "loss": stats["loss"] / max(1, len(minibatches) * a.epochs),
            "clip_ratio/low_mean": stats["low"] / tokens,
            "clip_ratio/high_mean": stats["high"] / tokens,
            "clip_ratio/region_mean": (stats["low"] + stats["high"]) / tokens,
            "entropy": stats["entropy"] / tokens,
            "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "learning_rate": lr,
            "num_minibatches": float(len(minibatches)),
            "train_tokens": stats["tokens"] / a.epochs,
            "time/train": time.perf_counter() - t0,
        }
        if self.ref_model is not None:
            metrics["kl"] = stats["kl"] / tokens
        return metrics

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        data = self.collect()
        metrics = dict(data.metrics)
        metrics.update(self.optimise(data.groups))
        self.step += 1
        metrics["time/step"] = time.perf_counter() - t0
        metrics["tokens_per_second/train"] = metrics["train_tokens"] / max(metrics["time/train"], 1e-9)
        return {"step": self.step, "epoch": self.schedule.epoch, **metrics}

    # ----- evaluation and the loop ---------------------------------------------------------

    def evaluate(self, tag: str) -> EvalResult:
        e = self.cfg.eval
        prompts = load_prompts(e.data)
        result = evaluate(self.model, self.tokenizer, prompts, self.verifier, template=self.cfg.model.template,
                          add_special_tokens=self.cfg.model.encode_special_tokens, k=e.k,
                          temperature=e.temperature, top_p=e.top_p,
                          max_new_tokens=e.max_new_tokens or self.sampling.max_new_tokens, seed=e.seed,
                          batch_size=self.cfg.rollout.batch_size)
        write_eval(result, self.out_dir / "eval", tag)
        return result

    def train(self, evaluate_before_after: bool = True) -> dict[str, Any]:
        from tqdm.auto import tqdm

        r = self.cfg.run
        summary: dict[str, Any] = {"run": r.name, "output_dir": str(self.out_dir)}
        if evaluate_before_after and self.step == 0:
            before = self.evaluate("step_000000")
            summary["eval_before"] = before.summary()
            self.metrics.write({"step": 0, "eval/pass@1": before.pass_at_1, "eval/stderr": before.stderr})
        bar = tqdm(total=r.steps, initial=self.step, desc=r.name, disable=self.quiet, dynamic_ncols=True)
        row: dict[str, float] = {}
        while self.step < r.steps:
            row = self.train_step()
            if r.eval_every and self.step % r.eval_every == 0 and self.step < r.steps:
                ev = self.evaluate(f"step_{self.step:06d}")
                row.update({"eval/pass@1": ev.pass_at_1, "eval/stderr": ev.stderr})
            self.metrics.write(row)
            if r.checkpoint_every and self.step % r.checkpoint_every == 0 and self.step < r.steps:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.3f}", all_fail=f"{row['frac_all_fail']:.2f}",
                            s_per_step=f"{row['time/step']:.1f}")
        bar.close()
        summary["final_checkpoint"] = str(self.save_checkpoint())
        summary["last_step"] = row
        if evaluate_before_after:
            after = self.evaluate(f"step_{self.step:06d}")
            summary["eval_after"] = after.summary()
            self.metrics.write({"step": self.step, "eval/pass@1": after.pass_at_1, "eval/stderr": after.stderr})
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        return summary

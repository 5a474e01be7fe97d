"""The per-model training loop: sample -> verify -> advantages -> update -> checkpoint.

docs/algorithm.md steps 1-4 and 11-14 with no peer. The trainer knows nothing about peers:
the step is split into phases (`collect`, `record`, `finish_step` -> `optimise`) so that
the GRAFT step (graft_fed/graft/step.py) puts peer groups between collection and
optimisation without touching either.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from graft_fed.configbase import to_dict
from graft_fed.core.advantages import advantage_id, group_advantages, successes
from graft_fed.core.exchange import mean_token_logprob, order_groups, split_minibatches
from graft_fed.core.losses import AGGREGATIONS, Normalizer, clipped_surrogate, k3_kl
from graft_fed.core.screening import peer_groups_of, update_is_finite
from graft_fed.data.config import load_prompts
from graft_fed.data.prompts import Prompt
from graft_fed.data.templates import render_prompt
from graft_fed.errors import CheckpointError
from graft_fed.evaluation import EvalResult, evaluate, write_eval
from graft_fed.fslock import LockHeld, LockUnsupported, hold_exclusive
from graft_fed.modeling import load_model_and_tokenizer, pack, resolve_device, response_forward, tokenizer_id
from graft_fed.rewards import build_verifier
from graft_fed.rollout.base import Completion
from graft_fed.rollout.hf import HFRollout, stream_seed
from graft_fed.store import TrajectoryStore
from graft_fed.trainer import checkpoint as ckpt
from graft_fed.trainer.config import TrainConfig
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.metrics import MetricsWriter, NullMetrics
from graft_fed.trainer.packing import token_budget_batches
from graft_fed.trainer.schedule import PromptSchedule

log = logging.getLogger("graft_fed.trainer")


@dataclass
class SampleStats:
    """What sampling and verifying one prompt batch cost."""

    rollout_s: float = 0.0
    verify_s: float = 0.0
    timeouts: int = 0
    errors: int = 0
    gen_tokens: int = 0


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


def previous_run(out_dir: Path) -> str:
    """What in `out_dir` belongs to a run that already trained there ("" when nothing): its
    checkpoints, a metrics.jsonl with rows, its summary.json."""
    found = []
    steps = [p.name for p in ckpt.checkpoint_dirs(out_dir / "checkpoints")]
    if steps:
        found.append(f"checkpoints {', '.join(steps[-3:])}" if len(steps) <= 3 else
                     f"{len(steps)} checkpoints up to {steps[-1]}")
    metrics = out_dir / "metrics.jsonl"
    try:
        rows = sum(1 for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        rows = 0
    if rows:
        found.append(f"metrics.jsonl with {rows} row{'s' if rows != 1 else ''}")
    if (out_dir / "summary.json").is_file():
        found.append("summary.json")
    return "; ".join(found)


def recorded_config(checkpoint: Path, fingerprint: str) -> dict[str, Any] | None:
    """The fingerprinted settings of the run that wrote `checkpoint`, from its run folder's
    config.json, when that config still has the checkpoint's fingerprint (for checkpoints
    whose manifest does not record them); None otherwise."""
    import warnings

    from graft_fed.configbase import from_mapping

    try:
        data = json.loads((Path(checkpoint).parent.parent / "config.json").read_text(encoding="utf-8"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            old = from_mapping(TrainConfig, data)
    except Exception:  # noqa: BLE001 - missing, unreadable or of another version: nothing to name
        return None
    return old.fingerprint_dict() if old.fingerprint() == fingerprint else None


def _numpy_state_to_plain(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)


class GRPOTrainer:
    """Trains one model with GRPO. GRAFT (graft_fed/graft/step.py) adds peer groups between
    `collect` and `finish_step`; this class knows nothing about peers."""

    def __init__(self, cfg: TrainConfig, resume: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.out_dir = Path(cfg.run.output_dir)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = self._resolve_device()
        self.autocast = (cfg.run.precision == "bf16" or
                         (cfg.run.precision == "auto" and self.device.type == "cuda"
                          and torch.cuda.is_bf16_supported()))
        self._seed_everything(cfg.run.seed)

        resume_dir = self._find_resume(resume)
        if resume is None:
            self._refuse_reused_output_dir()
        manifest = self._verify_resume(resume_dir) if resume_dir else None
        model_spec = str(resume_dir / "model") if resume_dir else cfg.model.path
        self.model, self.tokenizer = self._load_model(model_spec, trainable=True)
        # RL updates run without dropout: the ratio's denominator must be reproducible.
        self.model.eval()
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            ref_spec = cfg.model.path
            self.ref_model, _ = self._load_model(ref_spec, trainable=False)
            self.ref_model.eval().requires_grad_(False)

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.schedule, o.warmup_steps, cfg.run.steps, o.min_lr_ratio))
        self.engine: Any
        if cfg.rollout.backend == "vllm":
            from graft_fed.rollout.vllm import build_vllm_engine
            from graft_fed.zoo import resolve_model_path

            self.engine = build_vllm_engine(resolve_model_path(model_spec), self.tokenizer, self.model,
                                            cfg.rollout.vllm, seed=cfg.run.seed, device=self.device,
                                            add_special_tokens=cfg.model.encode_special_tokens)
        else:
            self.engine = HFRollout(self.model, self.tokenizer, batch_size=cfg.rollout.batch_size,
                                    seed=cfg.run.seed, add_special_tokens=cfg.model.encode_special_tokens)
        self.sampling = cfg.rollout.sampling_params()
        self.verifier = build_verifier(cfg.verifier)
        self.schedule = PromptSchedule(load_prompts(cfg.data), cfg.algorithm.prompts_per_step,
                                       cfg.run.prompt_schedule_seed)
        self.step = 0
        #: (source, prompt id) of the groups of the last step's minibatches whose update was not
        #: finite and was skipped (whoever trains on peer groups reports them)
        self.nonfinite_groups: list[tuple[str, str]] = []
        self.model_id = cfg.run.name
        self.run_id = f"{cfg.run.name}-seed{cfg.run.seed}"
        self.tok_id = tokenizer_id(self.tokenizer)
        self._lock_output_dir()  # before anything is written there
        self.store: TrajectoryStore | None = None
        self.metrics: MetricsWriter | NullMetrics = NullMetrics()
        try:
            self.store = (TrajectoryStore(self.out_dir / "trajectories.sqlite")
                          if cfg.run.record_groups and self.is_main else None)
            if self.store is not None:
                self.store.set_run_advantage(self.run_id,
                                             advantage_id(cfg.algorithm.scale_rewards, cfg.algorithm.std))
            if resume_dir is not None:
                self._restore(resume_dir, manifest)
                if self.is_main:
                    moved = ckpt.set_aside_after(self.out_dir / "checkpoints", self.step)
                    if moved:
                        log.warning("resumed from %s (step %d): the later checkpoints %s are set aside in %s, so that "
                                    "neither --resume nor pruning takes them for this run's", resume_dir, self.step,
                                    ", ".join(p.name for p in moved), moved[0].parent)
            if self.is_main:
                (self.out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2), encoding="utf-8")
                self.metrics = MetricsWriter(self.out_dir, tensorboard=cfg.run.tensorboard,
                                             resume_step=self.step if resume_dir else -1)
        except BaseException:
            if self.store is not None:
                self.store.close()
            self._unlock_output_dir()
            raise

    # ----- setup helpers ---------------------------------------------------------------
    # A torchrun run (graft_fed/trainer/distributed.py) overrides the hooks marked "hook".

    #: Whether this process writes the run's files (metrics, checkpoints' shared parts, evals).
    is_main = True
    #: What a checkpoint of this trainer holds; resuming refuses another layout (hook).
    checkpoint_layout = "single"

    def _resolve_device(self) -> torch.device:
        """hook"""
        return resolve_device(self.cfg.run.device)

    def _load_model(self, spec: str, trainable: bool) -> tuple[Any, Any]:
        """hook: the policy (trainable) or the KL reference model, and its tokenizer."""
        return load_model_and_tokenizer(spec, self.device)

    def _verify_resume(self, path: Path) -> dict[str, Any]:
        """hook: the checkpoint's manifest, after checking its files, config and layout."""
        manifest = ckpt.verify_checkpoint(path, self.cfg.fingerprint(), self.cfg.fingerprint_dict(),
                                          recorded=lambda fp: recorded_config(path, fp))
        ckpt.check_layout(path, manifest, self.checkpoint_layout)
        return manifest

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def _refuse_reused_output_dir(self) -> None:
        """A fresh run (no --resume) never writes into a folder that holds another run's
        checkpoints or metrics: its checkpoints would mix with theirs (and be pruned by step
        number), its metrics would follow theirs, and a later --resume would pick up theirs.
        Checked before anything is written (on the main process; every process refuses)."""
        found = previous_run(self.out_dir) if self.is_main else None
        found = self.from_main(found)
        if found:
            raise CheckpointError(
                f"run.output_dir {self.out_dir} already holds another run ({found}): resume it with --resume, "
                "or choose another run.output_dir (--set run.output_dir=...), or remove the folder")

    def _lock_output_dir(self) -> None:
        """Hold an exclusive lock on run.output_dir while this run lives (released by `close`,
        or by the kernel when the process dies). Two runs started into one folder at once (two
        nodes given the same output_dir, or a node started again while it still runs) both
        found it empty: their checkpoints replaced each other's and their metrics interleaved.
        The lock is the folder's own (flock on the directory): nothing is left in it."""
        self._output_dir_fd: int | None = None
        refusal = None
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            try:
                self._output_dir_fd = hold_exclusive(self.out_dir)
            except LockHeld:
                refusal = (f"run.output_dir {self.out_dir} is in use by another run that is still running (a "
                           "node or train process has it locked); two runs in one folder would replace each "
                           "other's checkpoints and mix their metrics. Give this run its own run.output_dir "
                           "(--set run.output_dir=...), or stop the other one first")
            except LockUnsupported as exc:  # a filesystem without flock: go on as before, unlocked
                log.warning("cannot lock run.output_dir %s (%s); nothing stops a second run from writing there",
                            self.out_dir, exc.strerror or exc)
        refusal = self.from_main(refusal)
        if refusal:
            raise CheckpointError(refusal)

    def _unlock_output_dir(self) -> None:
        fd, self._output_dir_fd = getattr(self, "_output_dir_fd", None), None
        if fd is not None:
            os.close(fd)  # and with it the lock

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
        if self.store is not None:
            self.store.close()
        self._unlock_output_dir()

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
                                    self._trainer_state(), self.cfg.fingerprint(), self.cfg.run.keep_checkpoints,
                                    config=self.cfg.fingerprint_dict())

    def _restore(self, path: Path, manifest: dict[str, Any] | None) -> None:
        state = ckpt.load_trainer_state(path)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.schedule.cursor = int(state["schedule_cursor"])
            rng = state["rng"]
            self._restore_rng(rng)
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {exc}") from None
        if manifest is not None and manifest["step"] != self.step:
            raise CheckpointError(f"checkpoint {path}: manifest step {manifest['step']} != state step {self.step}")
        log.info("resumed from %s at step %d", path, self.step)

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        """Python's, numpy's, torch's CPU and the rollout engine's RNG streams from a
        checkpoint's `rng` states (CUDA's is each layout's own: every device here, one per
        process under torchrun)."""
        random.setstate(rng["python"])
        np.random.set_state(_numpy_state_from_plain(rng["numpy"]))
        torch.set_rng_state(rng["torch"])
        self.engine.set_rng_state(rng["rollout"])

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
            batch_index = self.schedule.cursor
            prompts = self.schedule.next_batch()
            seeds = None
            if self.cfg.rollout.seeding == "prompt":
                seeds = [stream_seed(self.cfg.run.seed, batch_index, i) for i in range(len(prompts))]
            new, st = self._sample_groups(prompts, seeds)
            t_rollout += st.rollout_s
            t_verify += st.verify_s
            timeouts += st.timeouts
            errors += st.errors
            gen_tokens += st.gen_tokens
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

    def _generate(self, texts: list[str], seeds: list[int] | None) -> list[list[Completion]]:
        """hook: sample `self.sampling.n` responses per rendered prompt."""
        if seeds is None:
            return self.engine.generate(texts, self.sampling)
        return self.engine.generate(texts, self.sampling, seeds=seeds)

    def _sample_groups(self, prompts: Sequence[Prompt], seeds: list[int] | None) -> tuple[list[Group], SampleStats]:
        """hook: sample, verify and score one batch of prompts (`seeds`: one per prompt, or
        None for the engine's own stream)."""
        ta = time.perf_counter()
        completions = self._generate([self.render(p.problem) for p in prompts], seeds)
        tb = time.perf_counter()
        scored = self.verifier.score([c.text for g in completions for c in g],
                                     [p.answer for p, g in zip(prompts, completions) for _ in g])
        tc = time.perf_counter()
        new = self.make_groups(prompts, completions, scored.rewards)
        return new, SampleStats(rollout_s=tb - ta, verify_s=tc - tb, timeouts=scored.timeouts, errors=scored.errors,
                                gen_tokens=sum(len(c.token_ids) for g in completions for c in g))

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
        """Order the step's groups (peer-last by default, docs/algorithm.md step 13) and split them
        into minibatches of whole groups. Without peers every order but `shuffled` keeps
        the sampled order."""
        order = order_groups([g.is_peer for g in groups], self.cfg.graft.order,  # type: ignore[arg-type]
                             seed=self.cfg.run.seed * 1_000_003 + self.step)
        ordered = [groups[i] for i in order]
        return [[ordered[i] for i in r] for r in split_minibatches(len(ordered), self.cfg.algorithm.num_minibatches)]

    def _flatten(self, groups: Sequence[Group]) -> dict[str, Any]:
        prompt_ids, resp_ids, adv, weights, keep, peer = [], [], [], [], [], []
        mask_trunc = self.cfg.algorithm.mask_truncated
        for g in groups:
            w = g.weights if g.weights is not None else torch.ones(g.n)
            for c, a, wi, from_peer in zip(g.completions, g.advantages.tolist(), w.tolist(), g.peer_flags()):
                prompt_ids.append(g.prompt_ids)
                resp_ids.append(c.token_ids)
                adv.append(a)
                weights.append(wi)
                peer.append(1.0 if from_peer else 0.0)
                # A weight of exactly 0 is the GRAFT gate dropping the response (Eq. 8):
                # it leaves numerator AND denominator.
                keep.append(0.0 if (wi == 0.0 or (mask_trunc and c.finish_reason == "length")) else 1.0)
        return {"prompt_ids": prompt_ids, "resp_ids": resp_ids, "adv": torch.tensor(adv),
                "weights": torch.tensor(weights), "keep": torch.tensor(keep), "peer": torch.tensor(peer)}

    def _micro_batches(self, flat: dict[str, Any]) -> list[tuple[Any, Any]]:
        """hook: the minibatch's micro-batches as (rows of `flat`, packed batch) pairs."""
        a = self.cfg.algorithm
        n = len(flat["resp_ids"])
        if a.micro_batch_tokens:
            rows = token_budget_batches([len(p) for p in flat["prompt_ids"]], [len(r) for r in flat["resp_ids"]],
                                        range(n), a.micro_batch_tokens, a.micro_batch_size)
            return [self._pack_rows(flat, torch.tensor(r, dtype=torch.long)) for r in rows]
        out = []
        for s in range(0, n, a.micro_batch_size):
            sl = slice(s, min(n, s + a.micro_batch_size))
            batch = pack(flat["prompt_ids"][sl], flat["resp_ids"][sl], self.tokenizer.pad_token_id, self.device)
            batch.response_mask = batch.response_mask * flat["keep"][sl].to(self.device).unsqueeze(-1)
            out.append((sl, batch))
        return out

    def _pack_rows(self, flat: dict[str, Any], rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One micro-batch of the given rows of `flat` (a LongTensor of row indices)."""
        idx = rows.tolist()
        batch = pack([flat["prompt_ids"][i] for i in idx], [flat["resp_ids"][i] for i in idx],
                     self.tokenizer.pad_token_id, self.device)
        batch.response_mask = batch.response_mask * flat["keep"][rows].to(self.device).unsqueeze(-1)
        return rows, batch

    def _normalizer(self, flat: dict[str, Any], micro: list[tuple[Any, Any]]) -> Normalizer:
        """hook: one normaliser for the whole minibatch (Eq. 10's denominator), whatever
        the micro-batch split; peer responses may be longer than our own cap."""
        return Normalizer(tokens=sum(float(b.response_mask.sum()) for _, b in micro),
                          sequences=sum(float((b.response_mask.sum(-1) > 0).sum()) for _, b in micro),
                          max_response_len=self.sampling.max_new_tokens)

    def _agree(self, groups: Sequence[Group]) -> Sequence[Group]:
        """hook: the buffer every process trains on (under torchrun: the main process's)."""
        return groups

    def from_main(self, obj: Any) -> Any:
        """hook: the main process's `obj` on every process (under torchrun: a broadcast, which
        every process must call; e.g. what a federation node's main process got from the broker)."""
        return obj

    def _sum_across_processes(self, stats: dict[str, float]) -> dict[str, float]:
        """hook: per-process sums of the update's statistics -> the run's sums."""
        return stats

    def _all_processes(self, flag: bool) -> bool:
        """hook: whether `flag` holds on every process (under torchrun: an all-reduce, so all
        processes skip or take an optimiser step together)."""
        return flag

    def _forward(self, model: Any, batch: Any, with_entropy: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return response_forward(model, batch, temperature=self.sampling.temperature, with_entropy=with_entropy,
                                    entropy_grad=with_entropy and self.cfg.algorithm.entropy_coef > 0)

    @torch.no_grad()
    def score_responses(self, prompt_ids: Sequence[Sequence[int]],
                        resp_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[list[float]]]:
        """The current policy's teacher-forced log-likelihood of responses in this model's
        tokenisation: each response's mean token log-prob (Eq. 6, (B,)) and every token's
        log-prob. Under torchrun every process must call it with the same inputs."""
        mb = self.cfg.algorithm.micro_batch_size
        means, rows = [], []
        for s in range(0, len(resp_ids), mb):
            batch = pack(prompt_ids[s:s + mb], resp_ids[s:s + mb], self.tokenizer.pad_token_id, self.device)
            lp = self._forward(self.model, batch).logprobs.float()  # (b, T)
            means.append(mean_token_logprob(lp, batch.response_mask).cpu())
            rows.extend(lp[r, :len(resp_ids[s + r])].cpu().tolist() for r in range(lp.shape[0]))
        return (torch.cat(means) if means else torch.empty(0)), rows

    @torch.no_grad()
    def old_logprobs(self, micro: list[tuple[slice, Any]]) -> list[torch.Tensor]:
        """log pi_old on the trained model's tokenisation, before any update of this step (Eq. 9's
        denominator, for own and peer responses alike)."""
        return [self._forward(self.model, batch).logprobs.detach() for _, batch in micro]

    def optimise(self, groups: Sequence[Group]) -> dict[str, float]:
        a = self.cfg.algorithm
        t0 = time.perf_counter()
        minibatches = self.buffer_order(self._agree(groups))
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
        stats = {"tokens": 0.0, "low": 0.0, "high": 0.0, "entropy": 0.0, "kl": 0.0, "loss": 0.0,
                 "peer_tokens": 0.0, "peer_clipped": 0.0, "own_clipped": 0.0}
        grad_norms = []
        skipped = nonfinite = 0
        self.nonfinite_groups = []
        for _epoch in range(a.epochs):
            for mb, (flat, micro, old, ref) in zip(minibatches, prepared):
                norm = self._normalizer(flat, micro)
                if norm.tokens == 0:
                    # Every response of the minibatch is masked (gated out, or truncated under
                    # mask_truncated): its gradient is zero, but an AdamW step would still move
                    # the weights through momentum and weight decay.
                    skipped += 1
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
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
                        stats["kl"] += float((kl_tok.detach() * batch.response_mask).sum())
                    if a.entropy_coef > 0:
                        loss = loss - a.entropy_coef * agg(fwd.entropy, batch.response_mask, norm)
                    loss.backward()
                    m = batch.response_mask
                    stats["tokens"] += float(m.sum())
                    stats["low"] += float(out.clipped_low.sum())
                    stats["high"] += float(out.clipped_high.sum())
                    stats["entropy"] += float((fwd.entropy.detach() * m).sum())
                    is_peer = flat["peer"][sl].to(self.device).unsqueeze(-1)  # (b, 1)
                    clipped = (out.clipped_low | out.clipped_high).float()
                    stats["peer_tokens"] += float((m * is_peer).sum())
                    stats["peer_clipped"] += float((clipped * is_peer).sum())
                    stats["own_clipped"] += float((clipped * (1 - is_peer)).sum())
                    stats["loss"] += float(loss.detach())
                    mb_loss += float(loss.detach())
                if not self._all_processes(update_is_finite(mb_loss, self.model.parameters())):
                    # a NaN or an infinity (a poisoned peer group that got through, an overflow)
                    # never reaches the weights: skip the step, count it, name the groups
                    self.optimizer.zero_grad(set_to_none=True)
                    nonfinite += 1
                    self.nonfinite_groups.extend(peer_groups_of(mb))
                    continue
                clip = self.cfg.optim.grad_clip
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
                grad_norms.append(float(gn))
                self.optimizer.step()
        stats = self._sum_across_processes(stats)
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
            "skipped_minibatches": float(skipped),
            "skipped_nonfinite": float(nonfinite),
            "train_tokens": stats["tokens"] / a.epochs,
            "clip_ratio/own": stats["own_clipped"] / max(stats["tokens"] - stats["peer_tokens"], 1.0),
            "clip_ratio/peer": (stats["peer_clipped"] / stats["peer_tokens"]) if stats["peer_tokens"] else float("nan"),
            "time/train": time.perf_counter() - t0,
        }
        if self.ref_model is not None:
            metrics["kl"] = stats["kl"] / tokens
        return metrics

    def record(self, groups: Sequence[Group]) -> None:
        """Log this step's own groups to the run's trajectory store (so the run can serve as a
        stored peer later)."""
        if self.store is not None:
            self.store.record(g.to_record(self.step, self.model_id, self.tok_id, self.run_id) for g in groups)

    def train_step(self) -> dict[str, Any]:
        """One GRPO step with no peer."""
        t0 = time.perf_counter()
        data = self.collect()
        self.record(data.groups)
        return self.finish_step(data, data.groups, {}, t0)

    def finish_step(self, data: StepData, groups: Sequence[Group], extra: dict[str, Any], t0: float) -> dict[str, Any]:
        metrics: dict[str, Any] = dict(data.metrics)
        metrics.update(extra)
        metrics.update(self.optimise(groups))
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
                          batch_size=self.cfg.rollout.batch_size, seeding=e.seeding)
        if self.is_main:
            write_eval(result, self.out_dir / "eval", tag)
        return result

    def begin_train(self, evaluate_before_after: bool = True) -> dict[str, Any]:
        summary: dict[str, Any] = {"run": self.cfg.run.name, "output_dir": str(self.out_dir)}
        if evaluate_before_after and self.cfg.run.eval_before and self.step == 0:
            before = self.evaluate("step_000000")
            summary["eval_before"] = before.summary()
            self.metrics.write({"step": 0, "eval/pass@1": before.pass_at_1, "eval/stderr": before.stderr})
        return summary

    def end_step(self, row: dict[str, Any]) -> None:
        """Periodic evaluation, the metrics row, periodic checkpoint."""
        r = self.cfg.run
        if r.eval_every and self.step % r.eval_every == 0 and self.step < r.steps:
            ev = self.evaluate(f"step_{self.step:06d}")
            row.update({"eval/pass@1": ev.pass_at_1, "eval/stderr": ev.stderr})
        self.metrics.write(row)
        if r.checkpoint_every and self.step % r.checkpoint_every == 0 and self.step < r.steps:
            self.save_checkpoint()

    def end_train(self, summary: dict[str, Any], last_row: dict[str, Any],
                  evaluate_before_after: bool = True) -> dict[str, Any]:
        summary["final_checkpoint"] = str(self.save_checkpoint())
        summary["last_step"] = {k: v for k, v in last_row.items() if not isinstance(v, list)}
        if evaluate_before_after:
            after = self.evaluate(f"step_{self.step:06d}")
            summary["eval_after"] = after.summary()
            summary["eval_config"] = to_dict(self.cfg.eval)
            self.metrics.write({"step": self.step, "eval/pass@1": after.pass_at_1, "eval/stderr": after.stderr})
        if self.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        return summary

    def train(self, evaluate_before_after: bool = True,
              step_fn: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The loop: evaluate, then steps until run.steps (`step_fn` replaces train_step, e.g.
        the GRAFT step with some peers), checkpoints and metrics, then the final evaluation."""
        from tqdm.auto import tqdm

        step_fn = step_fn or self.train_step
        summary = self.begin_train(evaluate_before_after)
        bar = tqdm(total=self.cfg.run.steps, initial=self.step, desc=self.cfg.run.name, disable=self.quiet,
                   dynamic_ncols=True)
        row: dict[str, Any] = {}
        while self.step < self.cfg.run.steps:
            row = step_fn()
            self.end_step(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.3f}", all_fail=f"{row['frac_all_fail']:.2f}",
                            peer_groups=f"{row.get('graft/replaced', 0):.0f}", s_per_step=f"{row['time/step']:.1f}")
        bar.close()
        return self.end_train(summary, row, evaluate_before_after)

"""One model trained by several processes: torchrun + FSDP2 (`fully_shard`).

    torchrun --nproc-per-node K -m graft_fed.cli train --config X --set rollout.seeding=prompt

Every process holds 1/K of the parameters, gradients and AdamW state (FSDP2 shards each
transformer block and the root module). A step keeps the single-process semantics:

* **Rollouts.** The step's prompt batch is the same on every process (the schedule is a
  function of the seed and the batch number). Process r samples and verifies a contiguous
  share of it, whole groups only, with keyed sampling (rollout.seeding: prompt: each
  response's tokens come from its own stream keyed by run.seed, the batch number and its
  place in the batch), so what is sampled does not depend on K. Generation runs on full
  weights: the FSDP module is unsharded for the rollout (every process holds the whole
  model for that long, in the compute dtype) and resharded after, so a process decodes at
  its own pace without a collective per token. The groups are then all-gathered: every
  process sees the whole batch and runs the same deterministic exchange / GRAFT /
  minibatch logic; the buffer the update uses is the main process's (broadcast), so
  processes can never train on different buffers.
* **Update.** Each minibatch's responses are split among the processes (largest first to
  the least loaded), each packs its share into micro-batches (algorithm.micro_batch_size
  and micro_batch_tokens), and all run the same number of forward/backward passes (a
  process with fewer pads with an empty micro-batch, mask 0). The loss normaliser is
  computed from the whole minibatch (every process has it), and FSDP sums the gradient
  shards instead of averaging them, so the gradient is the single-process gradient up to
  float summation order.
* **Checkpoints** are torch.distributed.checkpoint (DCP) directories, sharded, plus a
  consolidated save_pretrained export, written under a temporary name and renamed into
  place with a manifest of sha256 digests (the guarantees of trainer/checkpoint.py).

Layout of one checkpoint of a torchrun run:

    checkpoints/step_000050/
        dcp/                 sharded model + optimiser state (one .distcp file per process)
        model/               consolidated weights (save_pretrained) and tokenizer
        trainer_state.pt     step, data cursor, LR scheduler
        rng/rank_00000.pt    each process's RNG states (python, numpy, torch, cuda, sampler)
        manifest.json        sha256 of every file, step, fingerprint, layout "fsdp", world size
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from graft_fed.errors import CheckpointError, ConfigError, GraftFedError
from graft_fed.trainer import checkpoint as ckpt
from graft_fed.trainer.config import TrainConfig
from graft_fed.trainer.group import Group
from graft_fed.trainer.grpo import GRPOTrainer, SampleStats, _numpy_state_to_plain
from graft_fed.trainer.packing import balance_shards, token_budget_batches

log = logging.getLogger("graft_fed.distributed")

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_joined_group = False  # this process joined a torch process group (see end_process)


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, ...)."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainConfig) -> DistContext:
    """Join the process group torchrun set up (idempotent: a second trainer in the same
    process, e.g. a cotrain member, reuses it). nccl on CUDA, gloo on CPU by default."""
    import torch.distributed as dist

    if not launched_by_torchrun():
        raise ConfigError("a distributed trainer needs the environment torchrun sets (RANK, WORLD_SIZE, "
                          "LOCAL_RANK, MASTER_ADDR, MASTER_PORT); launch with `torchrun --nproc-per-node K "
                          "-m graft_fed.cli train ...`")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    wanted = cfg.run.device
    on_cuda = torch.cuda.is_available() if wanted == "auto" else torch.device(wanted).type == "cuda"
    if on_cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device {wanted!r} asked for but no CUDA device is available; use 'cpu'")
        if local >= torch.cuda.device_count():
            raise ConfigError(f"process {rank} has LOCAL_RANK {local} but this machine has "
                              f"{torch.cuda.device_count()} CUDA devices: lower --nproc-per-node")
        if wanted != "auto" and torch.device(wanted).index not in (None, local):
            log.warning("run.device %s ignored: under torchrun process %d uses cuda:%d", wanted, rank, local)
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend nccl needs CUDA devices; use gloo (or auto) on CPU")
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise GraftFedError("the process group already set up in this process does not match torchrun's")
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    global _joined_group
    _joined_group = True
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device, backend=backend)


def shutdown() -> None:
    """Leave the process group (end of a torchrun command); a no-op otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> int:
    """Return `code`; in a process that joined a process group, end the process now with it.

    Why not return and let Python exit: a gloo worker thread can still hold the last
    reference to a finished collective (an all-gather's Python-owned tensors) when the
    interpreter starts to finalise. Dropping it needs the GIL, finalisation no longer hands
    it out, and the thread aborts the whole process (SIGABRT, "terminate called without an
    active exception") after a run that succeeded: 1 run in 13 of the 2-process test run
    on a loaded 2-core machine (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork
    -> decref -> take_gil -> pthread_exit; the race pytorch PR 179291 describes).
    `destroy_process_group` does not join those threads. By the time a command ends,
    everything it owns is closed (trainers, nodes and co-trainers are context managers
    that close their verifier pools, metrics files and stores; the process group is
    destroyed), so this flushes the streams and the log handlers and leaves with
    os._exit, skipping the finalisation that races.
    """
    if not _joined_group:
        return code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


# ----- sharding ---------------------------------------------------------------------------

def transformer_blocks(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class transformers marks as not to be
    split across devices (`_no_split_modules`, e.g. LlamaDecoderLayer, GPT2Block),
    outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in names and not any(name.startswith(b + ".") for b, _ in blocks):
            blocks.append((name, mod))
    if not blocks:
        raise ConfigError(f"{type(model).__name__} declares no transformer block class (_no_split_modules); "
                          "FSDP needs one unit per block")
    return [m for _, m in blocks]


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_model(model: torch.nn.Module, ctx: DistContext, *, bf16: bool, activation_checkpointing: bool,
                reshard_after_forward: bool) -> torch.nn.Module:
    """FSDP2 in place: one unit per transformer block plus the root (embeddings, final norm,
    head); the parameters move to ctx.device, 1/world_size of each on every process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = transformer_blocks(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        wrapped = []
        names = {id(m): n for n, m in model.named_modules()}
        for block in blocks:
            parent_name, _, child = names[id(block)].rpartition(".")
            w = checkpoint_wrapper(block)  # non-reentrant torch.utils.checkpoint
            setattr(model.get_submodule(parent_name), child, w)
            wrapped.append(w)
        blocks = wrapped
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    # bf16: gathered parameters and activations in bf16, gradients reduced and kept in fp32
    # together with the sharded fp32 master weights and optimiser state.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for unit in fsdp_modules(model):
        # Each process's loss is its share of the minibatch's sum / the GLOBAL normaliser:
        # the gradient is the SUM of the processes' gradients, not their mean.
        # A plain SUM reduce-scatter (no divide step) is also the one op gloo implements.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


@contextlib.contextmanager
def full_weights(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Hold every FSDP unit unsharded (all-gathered once, on every process) so that many
    forward passes (token-by-token decoding) run without collectives and at each
    process's own pace; reshard on exit. Collective: every process must enter it."""
    units = fsdp_modules(model)
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def share(count: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of `count` items that process `rank` of `world` takes (contiguous, sizes
    differ by at most one)."""
    return count * rank // world, count * (rank + 1) // world


# ----- the trainer -------------------------------------------------------------------------

class DistributedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer for one process of a torchrun run (see the module docstring)."""

    checkpoint_layout = "fsdp"

    def __init__(self, cfg: TrainConfig, resume: str | None = None, quiet: bool = False) -> None:
        if cfg.rollout.seeding != "prompt":
            raise ConfigError("a torchrun run samples each prompt on one process: set rollout.seeding: prompt "
                              "(--set rollout.seeding=prompt) so the samples do not depend on the number of "
                              "processes")
        if cfg.rollout.backend != "hf":
            raise ConfigError(f"rollout.backend {cfg.rollout.backend!r} is not supported under torchrun yet; "
                              "use the hf backend, or one process per node")
        self.ctx = init_distributed(cfg)
        self.is_main = self.ctx.is_main
        super().__init__(cfg, resume=resume, quiet=quiet or not self.is_main)

    # ----- hooks of GRPOTrainer ---------------------------------------------------------------

    def _resolve_device(self) -> torch.device:
        return self.ctx.device

    def _load_model(self, spec: str, trainable: bool) -> tuple[Any, Any]:
        from graft_fed.modeling import load_model_and_tokenizer

        # Every process reads the full weights into CPU memory once; fully_shard then keeps
        # 1/world_size of them on its device.
        model, tokenizer = load_model_and_tokenizer(spec, "cpu")
        d = self.cfg.distributed
        blocks = len(transformer_blocks(model))
        shard_model(model, self.ctx, bf16=self.autocast, reshard_after_forward=d.reshard_after_forward,
                    activation_checkpointing=d.activation_checkpointing and trainable)
        log.info("process %d/%d on %s (%s): %s sharded as %d blocks + root, bf16 %s, activation checkpointing %s",
                 self.ctx.rank, self.ctx.world_size, self.device, self.ctx.backend, spec, blocks, self.autocast,
                 d.activation_checkpointing and trainable)
        return model, tokenizer

    def _weights(self) -> contextlib.AbstractContextManager[None]:
        """The policy on full weights (collective; for sampling and evaluation)."""
        return full_weights(self.model, self.cfg.distributed.reshard_after_forward)

    def _generate(self, texts: list[str], seeds: list[int] | None) -> list:
        with self._weights():
            return super()._generate(texts, seeds)

    def _sample_groups(self, prompts: Sequence[Any], seeds: list[int] | None) -> tuple[list[Group], SampleStats]:
        import torch.distributed as dist

        assert seeds is not None  # rollout.seeding is "prompt" (checked in __init__)
        lo, hi = share(len(prompts), self.ctx.rank, self.ctx.world_size)
        if hi > lo:
            groups, stats = super()._sample_groups(prompts[lo:hi], seeds[lo:hi])
        else:
            self._generate([], [])  # fewer prompts than processes: still take part in the gather
            groups, stats = [], SampleStats()
        parts: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(parts, (groups, stats))
        every = [s for _, s in parts]
        return [g for gs, _ in parts for g in gs], SampleStats(
            rollout_s=max(s.rollout_s for s in every), verify_s=max(s.verify_s for s in every),
            timeouts=sum(s.timeouts for s in every), errors=sum(s.errors for s in every),
            gen_tokens=sum(s.gen_tokens for s in every))

    def _agree(self, groups: Sequence[Group]) -> Sequence[Group]:
        return self.from_main(list(groups) if self.is_main else None)

    def _all_processes(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def from_main(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _micro_batches(self, flat: dict[str, Any]) -> list[tuple[Any, Any]]:
        a = self.cfg.algorithm
        p_len = [len(p) for p in flat["prompt_ids"]]
        r_len = [len(r) for r in flat["resp_ids"]]
        shards = balance_shards([p + max(1, r) for p, r in zip(p_len, r_len)], self.ctx.world_size)

        def plan(rows: list[int]) -> list[list[int]]:
            if a.micro_batch_tokens:
                return token_budget_batches(p_len, r_len, rows, a.micro_batch_tokens, a.micro_batch_size)
            return [rows[s:s + a.micro_batch_size] for s in range(0, len(rows), a.micro_batch_size)]

        plans = [plan(rows) for rows in shards]  # every process computes every plan: no collective
        count = max(len(p) for p in plans)
        out = [self._pack_rows(flat, torch.tensor(rows, dtype=torch.long)) for rows in plans[self.ctx.rank]]
        while len(out) < count:
            # An empty micro-batch (one row, mask 0) keeps this process in step with the
            # others' forward/backward collectives and adds nothing to the gradient.
            rows, batch = self._pack_rows(flat, torch.tensor([0], dtype=torch.long))
            batch.response_mask = torch.zeros_like(batch.response_mask)
            out.append((rows, batch))
        return out

    def _normalizer(self, flat: dict[str, Any], micro: list[tuple[Any, Any]]) -> Any:
        from graft_fed.core.losses import Normalizer

        # The whole minibatch's counts (this process sees only its share of the micro-batches).
        lengths = torch.tensor([len(r) for r in flat["resp_ids"]], dtype=torch.float32)
        kept = flat["keep"].float()
        return Normalizer(tokens=float((kept * lengths).sum()), sequences=float(((kept > 0) & (lengths > 0)).sum()),
                          max_response_len=self.sampling.max_new_tokens)

    def _sum_across_processes(self, stats: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist

        keys = sorted(stats)
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return dict(zip(keys, t.tolist()))

    def evaluate(self, tag: str):  # type: ignore[override]
        # Every process evaluates the whole eval set on full weights (the same work in
        # parallel, so no process idles in a collective); only the main one writes.
        with self._weights():
            return super().evaluate(tag)

    # ----- checkpoints ------------------------------------------------------------------------

    def _rng_state(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": _numpy_state_to_plain(np.random.get_state()),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
                "rollout": self.engine.rng_state()}

    def save_checkpoint(self) -> Path:
        """Write a sharded checkpoint (every process) plus the consolidated model (main).

        A write that fails on any process (a full disk, an I/O error) becomes the same
        CheckpointError on every process, after every process has reached the same point, so
        no process is left waiting in a collective; the half-written folder is removed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        root = self.out_dir / "checkpoints"
        tmp = root / f".tmp_step_{self.step:06d}"
        failure: str | None = None
        if self.is_main:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "rng").mkdir(parents=True)
            except OSError as exc:
                failure = _describe(exc)
        self._agree_saved(failure, tmp, root)
        try:
            # collective: a write failing on any process raises CheckpointException on all of them
            dcp.save({"model": get_model_state_dict(self.model),
                      "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=tmp / "dcp")
        except dcp.CheckpointException as exc:
            failure = f"the sharded state could not be written ({exc})"
        self._agree_saved(failure, tmp, root)
        try:
            torch.save(self._rng_state(), tmp / "rng" / f"rank_{self.ctx.rank:05d}.pt")
        except OSError as exc:
            failure = _describe(exc)
        self._agree_saved(failure, tmp, root)  # every process's own files are on disk
        # The consolidated export (for evaluation, serving, or a new run's model.path):
        # gathered one tensor at a time into the main process's CPU memory; then the main
        # process hashes every file into the manifest.
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            try:
                for target, source in (getattr(self.model, "all_tied_weights_keys", None) or {}).items():
                    if target in full and source in full and torch.equal(full[target], full[source]):
                        del full[target]  # tied (e.g. lm_head = embeddings): saved once, as save_pretrained does
                self.model.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp / "model")
                torch.save({"step": self.step, "schedule_cursor": self.schedule.cursor,
                            "scheduler": self.scheduler.state_dict()}, tmp / "trainer_state.pt")
                ckpt.write_manifest(tmp, self.step, self.cfg.fingerprint(), layout=self.checkpoint_layout,
                                    world_size=self.ctx.world_size, config=self.cfg.fingerprint_dict())
            except OSError as exc:
                failure = _describe(exc)
        del full
        self._agree_saved(failure, tmp, root)
        final = root / f"step_{self.step:06d}"
        if self.is_main:
            try:
                final = ckpt.commit(tmp, root, self.step, self.cfg.run.keep_checkpoints)
            except OSError as exc:
                failure = _describe(exc)
        self._agree_saved(failure, tmp, root)
        return final

    def _agree_saved(self, failure: str | None, tmp: Path, root: Path) -> None:
        """All processes exchange how their part of the save went; if any failed, the main
        process removes `tmp` and every process raises the same CheckpointError."""
        import torch.distributed as dist

        reports: list[str | None] = [None] * self.ctx.world_size
        dist.all_gather_object(reports, failure)
        failed = [(rank, msg) for rank, msg in enumerate(reports) if msg]
        if not failed:
            return
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()  # tmp is gone before anyone reports it gone
        previous = ckpt.checkpoint_dirs(root)
        where = (f"the latest complete checkpoint, {previous[-1]}, is untouched" if previous
                 else "there is no earlier checkpoint")
        what = "; ".join(f"process {rank}: {msg}" for rank, msg in failed)
        raise CheckpointError(f"could not write the checkpoint of step {self.step} under {root} ({what}); "
                              f"nothing half-written was kept and {where}. Free disk space (or lower "
                              "run.keep_checkpoints) and resume.")

    def _verify_resume(self, path: Path) -> dict[str, Any]:
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = super()._verify_resume(path)
            except CheckpointError as exc:
                box[0] = exc
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], CheckpointError):
            raise CheckpointError(str(box[0]))
        return box[0]

    def _restore(self, path: Path, manifest: dict[str, Any] | None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        state = ckpt.load_trainer_state(path)
        ckpt.check_dcp_metadata(path / "dcp")  # dcp.load unpickles it: nothing but checkpoint metadata
        try:
            sharded = {"model": get_model_state_dict(self.model),
                       "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(sharded, checkpoint_id=path / "dcp")  # reshards when the process count changed
            set_model_state_dict(self.model, sharded["model"])
            set_optimizer_state_dict(self.model, self.optimizer, sharded["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.schedule.cursor = int(state["schedule_cursor"])
        except (KeyError, ValueError, RuntimeError, TypeError, dcp.CheckpointException) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {exc}") from None
        saved = int(manifest.get("world_size", 0)) if manifest else 0
        rng_file = path / "rng" / f"rank_{self.ctx.rank:05d}.pt"
        if rng_file.is_file():
            try:
                rng = torch.load(rng_file, map_location="cpu", weights_only=True)
                self._restore_rng(rng)
                if rng["cuda"] is not None and self.device.type == "cuda":
                    torch.cuda.set_rng_state(rng["cuda"], self.device)
            except (KeyError, IndexError, ValueError, RuntimeError, TypeError, EOFError, pickle.UnpicklingError,
                    OSError) as exc:
                raise CheckpointError(f"checkpoint {path}: process {self.ctx.rank}'s RNG states ({rng_file}) "
                                      f"cannot be restored ({type(exc).__name__}: {exc}); resume from another "
                                      "checkpoint") from None
        if saved != self.ctx.world_size and self.is_main:
            # Samples are keyed by prompt, so they do not depend on the process count; the
            # model and optimiser shards were resharded by DCP.
            log.warning("checkpoint %s was written by %d processes and this run has %d: resharded; processes "
                        "without a saved RNG file keep their fresh RNG streams", path, saved,
                        self.ctx.world_size)
        if manifest is not None and manifest["step"] != self.step:
            raise CheckpointError(f"checkpoint {path}: manifest step {manifest['step']} != state step {self.step}")
        log.info("resumed from %s at step %d", path, self.step)


def make_trainer(cfg: TrainConfig, resume: str | None = None, quiet: bool = False) -> GRPOTrainer:
    """The trainer for this process: distributed under torchrun, the plain one otherwise."""
    if launched_by_torchrun():
        return DistributedGRPOTrainer(cfg, resume=resume, quiet=quiet)
    return GRPOTrainer(cfg, resume=resume, quiet=quiet)


def _describe(exc: OSError) -> str:
    return f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc.strerror or exc)

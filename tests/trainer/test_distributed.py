"""Training one model with torchrun + FSDP2 on CPU (gloo, 2 processes, the zoo's tiny Llama):
the run must reproduce the single-process run (graft_fed/trainer/distributed.py).

Tolerances. Both runs sample the same responses (keyed sampling, rollout.seeding: prompt)
and compute the same float32 loss; they differ only in float summation order (different
micro-batch shapes, two gradient shards summed by the reduce-scatter, the grad norm summed
over shards), about 1e-7 relative. Metrics are compared at rtol 1e-5 / atol 1e-6 (the
loss of the first minibatch is ~1e-4, hence the absolute part). Parameters are compared
at atol 1e-5 after 6 AdamW steps of lr 1e-2 that move them by ~3e-2 (measured difference:
~2e-7). These runs use AdamW eps 1e-3 instead of 1e-8: Adam divides each gradient entry by
its own magnitude, so an entry whose true gradient is zero (GPT-2's key biases: softmax
ignores a shift shared by all keys) but whose computed gradient is rounding noise gets a
step of up to lr, of random sign, in either run; with eps 1e-3 noise moves nothing while
real gradients (1e-3 and up here) still take lr-sized steps. A wrong gradient (a lost
shard, a wrong normaliser) would show in the loss and grad_norm metrics and move most
entries by O(lr).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from graft_fed.errors import CheckpointError
from graft_fed.trainer import checkpoint as ckpt
from graft_fed.trainer.config import load_train_config
from graft_fed.trainer.grpo import GRPOTrainer
from graft_fed.trainer.metrics import read_metrics
from graft_fed.trainer.packing import balance_shards, token_budget_batches

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def write_cfg(tmp: Path, name: str, **over) -> Path:
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                                   for i in range(12)))
    base = {
        "run": {"output_dir": str(tmp / name), "steps": STEPS, "seed": 7, "device": "cpu", "checkpoint_every": 1,
                "keep_checkpoints": 5, "threads": 1, "eval_before": False},
        "model": {"path": "zoo:tiny-llama-char", "template": "chat"},
        "data": {"source": str(prompts)},
        "rollout": {"n": 4, "max_new_tokens": 6, "batch_size": 16, "seeding": "prompt"},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 4, "num_minibatches": 2, "micro_batch_size": 3, "micro_batch_tokens": 40},
        "optim": {"lr": 1e-2, "eps": 1e-3},
        # A rank whose peer died stops within two minutes, not the default half hour.
        "distributed": {"timeout_s": 120},
    }
    for dotted, value in over.items():
        node = base
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m ARGS` on this machine; the rendezvous binds a free
    loopback port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def compared(row: dict) -> dict:
    """The metrics that must agree (wall-clock times and rates never do)."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith(("time/", "tokens_per"))}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, Path]:
    """One 2-process run of STEPS steps through the CLI, as a user launches it."""
    tmp = tmp_path_factory.mktemp("fsdp")
    cfg = write_cfg(tmp, "two")
    ok(torchrun("graft_fed.cli", "train", "--config", str(cfg), "--no-eval", "--quiet"))
    return tmp, tmp / "two"


def test_two_processes_match_one_process(two_processes):
    tmp, two = two_processes
    cfg = load_train_config(write_cfg(tmp, "one"))
    with GRPOTrainer(cfg, quiet=True) as tr:
        tr.train(evaluate_before_after=False)
    one_rows, two_rows = read_metrics(tmp / "one" / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in two_rows] == [1, 2, 3]
    for a, b in zip(one_rows, two_rows):
        a, b = compared(a), compared(b)
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6, nan_ok=True), (a["step"], key)
    assert sum(r["grad_norm"] > 0 for r in two_rows) >= 2 and any(0 < r["reward"] < 1 for r in two_rows)
    want, got = weights(tmp / "one"), weights(two)
    assert want.keys() == got.keys()  # the consolidated export saves tied weights once, as save_pretrained
    start = weights_of_zoo()
    moved = max((want[k] - start[k]).abs().max().item() for k in want)
    assert moved > 1e-2  # the runs did train (6 AdamW steps of lr 1e-2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)


def weights_of_zoo() -> dict[str, torch.Tensor]:
    from graft_fed.zoo import resolve_model_path

    return load_file(Path(resolve_model_path("zoo:tiny-llama-char")) / "model.safetensors")


def test_sharded_checkpoint_resume_matches_uninterrupted_run(two_processes):
    tmp, two = two_processes
    first = two / "checkpoints" / "step_000001"
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["layout"] == "fsdp" and manifest["world_size"] == 2 and manifest["step"] == 1
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng/rank_00000.pt", "rng/rank_00001.pt",
            "trainer_state.pt", "model/model.safetensors"} <= set(manifest["files"])
    # Resume from step 1 in a fresh directory, with activation checkpointing on (it
    # recomputes the same float ops, so the result must not move either).
    out = tmp / "resumed"
    cfg = write_cfg(tmp, "resumed", **{"distributed.activation_checkpointing": True})
    ok(torchrun("graft_fed.cli", "train", "--config", str(cfg), "--no-eval", "--quiet", "--resume", str(first)))
    rows, want = read_metrics(out / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 3]
    for a, b in zip(want[1:], rows):
        assert compared(a) == compared(b)
    got, ref = weights(out), weights(two)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_fsdp_checkpoints_are_verified_and_not_mistaken_for_single_process_ones(two_processes):
    tmp, two = two_processes
    path = tmp / "copied_step_2"
    shutil.copytree(two / "checkpoints" / "step_000002", path)
    cfg = load_train_config(write_cfg(tmp, "plain"))
    with pytest.raises(CheckpointError, match=r"torchrun \(FSDP2\) run of 2 processes.*single-process run"):
        GRPOTrainer(cfg, resume=str(path), quiet=True)
    shard = path / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: dcp/__1_0.distcp"):
        ckpt.verify_checkpoint(path, cfg.fingerprint())  # what the main process checks before resuming


def test_gradient_is_the_single_process_gradient_whatever_the_micro_batching(tmp_path):
    """Two processes with two micro-batchings (a token budget of 30 and at most 2 rows;
    64 rows) and one process: every minibatch's gradient is the same. Also
    runs bf16 mixed precision with activation checkpointing and a sharded KL reference
    model (exercised on CPU: it must train, not match fp32)."""
    cfgs = [write_cfg(tmp_path, "budget", **{"algorithm.micro_batch_tokens": 30, "algorithm.micro_batch_size": 2}),
            write_cfg(tmp_path, "rows", **{"algorithm.micro_batch_tokens": 0, "algorithm.micro_batch_size": 64}),
            write_cfg(tmp_path, "bf16", **{"run.precision": "bf16", "distributed.activation_checkpointing": True,
                                           "distributed.reshard_after_forward": False, "algorithm.kl_coef": 0.1})]
    out = tmp_path / "grads.pt"
    ok(torchrun("tests.trainer.dist_worker", str(out), *map(str, cfgs)))
    got = torch.load(out, weights_only=False)
    grads = got["grads"]
    cfg = load_train_config(cfgs[1])
    with GRPOTrainer(cfg, quiet=True) as tr:
        seen = []
        tr.optimizer.step = lambda: seen.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
        tr.train_step()
    single = torch.stack(seen)
    assert single.shape[0] == 2 and single.abs().sum() > 0
    for g in grads[:2]:
        torch.testing.assert_close(g, single, atol=1e-6, rtol=1e-4)
    bf16_row = got["rows"][2]
    assert math.isfinite(bf16_row["loss"]) and bf16_row["grad_norm"] > 0 and bf16_row["kl"] >= 0
    assert grads[2].shape == single.shape and torch.isfinite(grads[2]).all()


def test_token_budget_micro_batches_do_not_change_the_single_process_gradient(tmp_path):
    grads = []
    for name, over in (("rows", {"algorithm.micro_batch_tokens": 0, "algorithm.micro_batch_size": 64}),
                       ("budget", {"algorithm.micro_batch_tokens": 25})):
        cfg = load_train_config(write_cfg(tmp_path, name, **over))
        with GRPOTrainer(cfg, quiet=True) as tr:
            seen, sizes = [], []
            orig = tr._micro_batches
            tr._micro_batches = lambda flat: sizes.append(len(m := orig(flat))) or m
            tr.optimizer.step = lambda: seen.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
            tr.train_step()
            grads.append((torch.stack(seen), sizes))
    (full, one_each), (packed, several) = grads
    assert one_each == [1, 1] and min(several) >= 2  # the budget did split each minibatch
    torch.testing.assert_close(packed, full, atol=1e-6, rtol=1e-4)


def test_token_budget_packing_and_shards():
    prompt = [5, 5, 9, 2, 5, 5, 1]
    resp = [10, 3, 30, 4, 0, 7, 12]
    batches = token_budget_batches(prompt, resp, range(7), budget=40, max_rows=3)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        cost = len(b) * (max(prompt[i] for i in b) + max(max(1, resp[i]) for i in b))
        assert len(b) <= 3 and (cost <= 40 or len(b) == 1)
    assert [2] in batches  # 9 + 30 tokens fills the budget alone
    assert token_budget_batches(prompt, resp, [1, 3], budget=5, max_rows=8) == [[1], [3]]  # longer than the budget
    shards = balance_shards([10, 1, 7, 3, 3], 2)
    assert sorted(shards[0] + shards[1]) == [0, 1, 2, 3, 4]
    assert abs(sum([10, 1, 7, 3, 3][i] for i in shards[0]) - sum([10, 1, 7, 3, 3][i] for i in shards[1])) <= 2
    assert balance_shards([1.0], 3) == [[0], [], []]


def test_cotrain_under_torchrun_matches_one_process(tmp_path):
    """Two models co-trained by 2 processes (each sharded over both) exchange and train as
    in one process: the receive path's likelihood passes run on the sharded models."""
    from graft_fed.graft.cotrain import CoTrainer, load_cotrain_config

    def cotrain_cfg(name: str) -> Path:
        path = write_cfg(tmp_path, name, **{"run.seed": 5, "run.steps": 2, "run.checkpoint_every": 0,
                                            "rollout.n": 4, "algorithm.micro_batch_tokens": 0,
                                            "graft.balance": "none"})  # 4 prompts: the paired rule often moves nothing
        cfg = yaml.safe_load(path.read_text())
        del cfg["model"]
        cfg["members"] = [{"name": "llama", "model": {"path": "zoo:tiny-llama-char"}},
                          {"name": "gpt2", "model": {"path": "zoo:tiny-gpt2-bpe"}}]
        path.write_text(yaml.safe_dump(cfg))
        return path

    ok(torchrun("graft_fed.cli", "cotrain", "--config", str(cotrain_cfg("co2")), "--no-eval", "--quiet"))
    with CoTrainer(load_cotrain_config(cotrain_cfg("co1")), quiet=True) as co:
        co.train(evaluate_before_after=False)
    replaced = 0.0
    for member in ("llama", "gpt2"):
        one = read_metrics(tmp_path / "co1" / member / "metrics.jsonl")
        two = read_metrics(tmp_path / "co2" / member / "metrics.jsonl")
        assert len(one) == len(two) == 2
        for a, b in zip(one, two):
            a, b = compared(a), compared(b)
            assert a.keys() == b.keys()
            # the loss sums terms of both signs (advantages +-), so its float32 rounding is
            # relative to the terms, not to the small sum (measured: 2.5e-6 on a loss of 0.058
            # whose grad_norm and weights agree at 1e-5)
            bad = {key: (a[key], b[key]) for key in a
                   if b[key] != pytest.approx(a[key], rel=1e-5, abs=1e-5 if key == "loss" else 1e-6, nan_ok=True)}
            assert not bad, (member, a["step"], bad)
        replaced += sum(r.get("graft/replaced", 0) for r in two)
        want, got = weights(tmp_path / "co1" / member, 2), weights(tmp_path / "co2" / member, 2)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
    assert replaced >= 3  # peer groups were received, in both directions at this seed


def test_resume_with_another_process_count(two_processes):
    """DCP reshards: the 2-process checkpoint of step 2 resumed by one process gives the
    2-process run's step 3 (keyed samples do not depend on the process count)."""
    tmp, two = two_processes
    cfg = write_cfg(tmp, "one_proc_resumed")
    ok(torchrun("graft_fed.cli", "train", "--config", str(cfg), "--no-eval", "--quiet", "--resume",
                str(two / "checkpoints" / "step_000002"), nproc=1))
    (row,) = read_metrics(tmp / "one_proc_resumed" / "metrics.jsonl")
    want = compared(read_metrics(two / "metrics.jsonl")[2])
    assert row["step"] == 3
    for key, value in want.items():
        assert compared(row)[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
    got, ref = weights(tmp / "one_proc_resumed"), weights(two)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0, msg=k)


def test_torchrun_runs_refuse_what_they_cannot_do(tmp_path, monkeypatch, capsys):
    from graft_fed import cli
    from graft_fed.errors import ConfigError
    from graft_fed.trainer.distributed import DistributedGRPOTrainer

    cfg = load_train_config(write_cfg(tmp_path, "stream", **{"rollout.seeding": "stream"}))
    with pytest.raises(ConfigError, match="set rollout.seeding: prompt"):
        DistributedGRPOTrainer(cfg)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["eval", "--model", "zoo:tiny-llama-char", "--benchmark", "embedded:arith-v1"]) == 2
    assert "only train, cotrain and node run under torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["rng@1", "model@0"])
def test_a_save_failing_on_one_process_fails_cleanly_on_all(tmp_path, fault):
    """A full disk on one process during a sharded save: every process raises the same
    CheckpointError (none is left waiting in a collective), nothing half-written is kept, and
    the previous checkpoint stays complete and resumable."""
    cfg = write_cfg(tmp_path, "faulty")
    prefix = tmp_path / "outcome"
    ok(torchrun("tests.trainer.dist_ckpt_worker", str(prefix), str(cfg), fault))
    outcomes = [json.loads((tmp_path / f"outcome.{r}.json").read_text()) for r in range(2)]
    failing = int(fault.split("@")[1])
    for o in outcomes:
        assert o["raised"] and "could not write the checkpoint of step 1" in o["raised"]
        assert f"process {failing}: No space left on device" in o["raised"]
        assert "step_000000" in o["raised"] and "is untouched" in o["raised"]
    assert outcomes[0]["raised"] == outcomes[1]["raised"]
    ckpts = tmp_path / "faulty" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000000"]
    ckpt.verify_checkpoint(ckpts / "step_000000")


def test_a_process_that_joined_a_group_ends_with_its_code_and_everything_written(tmp_path):
    """end_process: the CLI's way out of a torchrun process (no interpreter finalisation, which
    races gloo's threads). Whatever was printed or logged before still arrives, and the code is
    the command's; outside a group it only returns the code."""
    from graft_fed.trainer import distributed

    assert distributed.end_process(3) == 3  # this pytest process joined no group
    log = tmp_path / "log.txt"
    script = ("import logging, sys\n"
              "from graft_fed.trainer import distributed\n"
              f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
              "distributed._joined_group = True\n"
              "print('to stdout', end='')\n"
              "sys.stderr.write('to stderr')\n"
              "logging.getLogger('x').info('logged')\n"
              "distributed.end_process(3)\n"
              "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (res.returncode, res.stdout, res.stderr) == (3, "to stdout", "to stderr")
    assert "logged" in log.read_text()


def test_rng_states_that_do_not_fit_are_a_checkpoint_error(two_processes):
    """A process's RNG file that passes its digest but holds other states (a checkpoint of
    another version, edited with its manifest) is refused by name, not a KeyError traceback."""
    import hashlib

    tmp, two = two_processes
    path = tmp / "odd_rng_step_2"
    shutil.copytree(two / "checkpoints" / "step_000002", path)
    rng = path / "rng" / "rank_00000.pt"
    torch.save({"python": None}, rng)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["rng/rank_00000.pt"] = hashlib.sha256(rng.read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    cfg = write_cfg(tmp, "odd_rng")
    res = torchrun("graft_fed.cli", "train", "--config", str(cfg), "--no-eval", "--quiet", "--resume", str(path),
                   nproc=1)
    assert res.returncode != 0  # torchrun reports its worker's exit 2 with a traceback of its own
    assert "graft-fed train: error: checkpoint" in res.stderr and "process 0's RNG states" in res.stderr
    assert "rank_00000.pt" in res.stderr and "resume from another checkpoint" in res.stderr, res.stderr[-3000:]
    assert 'File "' + str(ROOT / "graft_fed") not in res.stderr  # no traceback through graft_fed's code

"""GPU check: one full GRAFT co-training step of two 1-2B models, with throughput and MFU.

    bash bench/gpu_check.sh                 # one GPU, no internet; 87 s on an H200 without vllm
    python bench/gpu_check.py --tiny        # the same logic on CPU with toy sizes (seconds)

What it does, all offline:

1. Builds two models with the real architectures' configs, randomly initialised:
   Qwen3-1.7B-Base's (1.72 B parameters) and Llama-3.2-1B's (1.24 B; the architecture of
   OctoThinker-1B; the paper's OctoThinker-3B is the same family at 3.21 B). The config
   values are written below; nothing is downloaded.
2. Gives each a tokenizer built here: a word-level tokenizer whose vocabulary size equals
   the model's (151,936 and 128,256), so the LM head, the log-softmax over the vocabulary and
   the sampler cost what they cost for the real models. Its first entries are the words,
   digits and symbols of the embedded task's prompts (digits one per token), so prompts
   encode without unknowns; the rest are filler words ("q17", "l17") that differ between the
   two models, so a peer's text re-tokenises into the receiver's vocabulary the way text
   from a different real tokenizer does (mostly into pieces the receiver's sampler would not
   emit). The shipped zoo tokenizers were not used because a 99-entry vocabulary would make
   the LM head, the largest single matmul of a 1.7 B model, nearly free.
3. Co-trains them for one warm-up step (short responses) and one timed step with the
   transformers rollout backend through `graft_fed.graft.cotrain.CoTrainer`, on the
   embedded task's prompts. A random model never solves a problem, so the reward is a
   plugin (`complementary_reward` below) that makes each model informative on half of the
   prompts and all-fail on the other half: every step then exchanges groups in both
   directions and the receiver's GRAFT likelihood pass runs, as in a real run.
4. Measures the bf16 matmul rate of this GPU in the same process (a timed loop of large
   torch.matmul) and reports per model: rollout tokens/s, training tokens/s, and model
   FLOP utilisation against that rate, with 2*N FLOPs per generated token and 6*N per
   trained token (N = parameters, the tied embedding once; attention's sequence-length
   term is left out, so MFU is slightly understated).
5. Repeats the timed step with the vLLM backend when vllm is importable (optional).
6. Before all that, the checks a first run of the vLLM backend needs (`vllm_checks`), on the
   shipped tiny-llama-char model with an fp32 engine, each reported as ok / not ok with its
   measurement: the engine path taken (in-process or vLLM's RPC); per-token log-probs
   against a teacher-forced forward pass of the trainer's model; weights scaled, synced
   (twice: the second rollout after a sync is where a broken RPC payload fails), and the
   log-probs following; finish reasons at the length cap (an EOS as the last allowed token
   is "stop", and what the installed vLLM itself reports); seeded reproducibility (run
   seed resumed, per-prompt keys); processed log-probs at temperature 0.7; the memory
   hand-over (the trainer fills the GPU and frees it into PyTorch's cache, and the engine
   must still wake). Without vllm or a GPU it says which checks could not run and why.

Writes OUT/gpu_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

# Values of the released models' config.json files (Qwen/Qwen3-1.7B-Base and
# meta-llama/Llama-3.2-1B); rope scaling is left out (it does not change any cost here).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, hidden_act="silu"),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, hidden_act="silu"),
}
# Filler-word prefix of each model's tokenizer: the reward below tells the models apart by it.
FAMILY = {"qwen3-1.7b": "q", "llama-3.2-1b": "l"}
TINY_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=512, max_position_embeddings=512)

SPECIALS = ["<pad>", "<eos>", "<unk>"]


# ----- reward ----------------------------------------------------------------------------------


def _parity(answer: str) -> int:
    try:
        return int(float(answer)) % 2
    except ValueError:
        return len(answer) % 2


def complementary_reward(response: str, answer: str) -> float:
    """A verifier plugin for random models: prompts with an even answer belong to the "q"
    model, odd ones to the "l" model. The owner's responses score a text-determined coin
    flip (so its groups are informative), the other model's score 0 (all-fail groups), so
    each model receives peer groups on the prompts it does not own."""
    words = response.split()
    family = words[0][:1] if words else ""
    if family != ("q" if _parity(answer) == 0 else "l"):
        return 0.0
    return float(sum(map(ord, response)) % 2)


# ----- models and tokenizers ---------------------------------------------------------------------


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])


def prompt_words(template: str = "paper") -> list[str]:
    """Every word, digit and symbol of the embedded task's rendered prompts, sorted."""
    from graft_fed.data import task
    from graft_fed.data.templates import render_prompt

    pre = _pre_tokenizer()
    words: set[str] = set()
    for split in ("train", "test"):
        for p in task.embedded_split(split, seed=0):
            words.update(w for w, _ in pre.pre_tokenize_str(render_prompt(p.problem, template)))
    return sorted(words)


def build_tokenizer(out_dir: Path, vocab_size: int, filler: str, words: list[str]) -> Any:
    """A word-level tokenizer of exactly `vocab_size` entries (see the module docstring)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocabulary of {vocab_size} cannot hold the {len(vocab)} prompt words")
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"{filler}{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = _pre_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def arch_config(name: str, tiny: bool) -> dict[str, Any]:
    cfg = dict(ARCHS[name])
    if tiny:
        cfg.update(TINY_DIMS)
    return cfg


def build_model(out_dir: Path, name: str, tiny: bool, device: torch.device, words: list[str], seed: int) -> int:
    """Save a randomly initialised model + tokenizer to `out_dir`; returns its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = arch_config(name, tiny)
    model_type = spec.pop("model_type")
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, spec["vocab_size"], FAMILY[name], words)
    config = AutoConfig.for_model(model_type, pad_token_id=0, eos_token_id=1, bos_token_id=None, **spec)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: seconds instead of minutes on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out_dir)  # bf16 on disk; the trainer loads fp32
    del model
    return n_params


# ----- measurements ------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, size: int, seconds: float) -> dict[str, Any]:
    """bf16 TFLOP/s of a timed loop of (size x size) @ (size x size) on `device`."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    _sync(device)
    iters, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10):
            torch.matmul(a, b)
        iters += 10
        _sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return {"dtype": "bfloat16", "size": size, "iterations": iters, "seconds": elapsed,
            "tflops": 2 * size**3 * iters / elapsed / 1e12}


def cotrain_config(out: Path, models: dict[str, Path], args: argparse.Namespace, backend: str) -> Any:
    from graft_fed.graft.cotrain import load_cotrain_config

    import yaml

    data = {
        "run": {"name": "gpu-check", "output_dir": str(out / f"run-{backend}"), "steps": 10, "seed": 0,
                "device": args.device, "threads": 1 if args.tiny else 0, "checkpoint_every": 0, "eval_before": False, "record_groups": False},
        "data": {"source": "embedded:arith-v1", "split": "train"},
        "rollout": {"backend": backend, "n": args.n, "max_new_tokens": args.max_new_tokens,
                    "batch_size": args.prompts * args.n,
                    "vllm": {"gpu_memory_utilization": args.vllm_memory, "max_model_len": 1024}},
        "verifier": {"name": "gpu_check:complementary_reward"},
        "algorithm": {"prompts_per_step": args.prompts, "num_minibatches": 2, "micro_batch_size": args.micro_batch},
        "members": [{"name": name, "model": {"path": str(path), "template": "paper"}} for name, path in models.items()],
    }
    path = out / f"cotrain-{backend}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return load_cotrain_config(path)


def _count_training_tokens(trainer: Any, sink: dict[str, float]) -> None:
    """Record the real (unpadded) tokens that each optimise() call runs forward and backward."""
    original = trainer.optimise

    def optimise(groups):
        sink["train_tokens"] = float(trainer.cfg.algorithm.epochs * sum(
            len(g.prompt_ids) * g.n + sum(len(c.token_ids) for c in g.completions) for g in groups))
        return original(groups)

    trainer.optimise = optimise


def run_backend(backend: str, models: dict[str, Path], n_params: dict[str, int], rate: float,
                args: argparse.Namespace, out: Path, log: Any = print) -> dict[str, Any]:
    from graft_fed.graft.cotrain import CoTrainer

    device = torch.device(args.device)
    cfg = cotrain_config(out, models, args, backend)
    t0 = time.perf_counter()
    cot = CoTrainer(cfg, quiet=True)
    setup_s = time.perf_counter() - t0
    log(f"{backend} backend: both members set up in {setup_s:.1f} s")
    sinks = {t.model_id: {} for t in cot.trainers}
    for t in cot.trainers:
        _count_training_tokens(t, sinks[t.model_id])
    try:
        # Warm-up: the same step with short responses (CUDA context, cuBLAS handles, allocator).
        full = [t.sampling for t in cot.trainers]
        for t in cot.trainers:
            t.sampling = dataclasses.replace(t.sampling, max_new_tokens=min(16, args.max_new_tokens))
        t0 = time.perf_counter()
        cot.train_step()
        warmup_s = time.perf_counter() - t0
        log(f"{backend} backend: warm-up step ({min(16, args.max_new_tokens)} new tokens) {warmup_s:.1f} s")
        for t, sp in zip(cot.trainers, full):
            t.sampling = sp
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        rows = cot.train_step()
        _sync(device)
        step_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    finally:
        cot.close()
        del cot
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    members = {}
    for row, (name, sink) in zip(rows, sinks.items()):
        n = n_params[name]
        gen_tokens = float(round(row["tokens_per_second/rollout"] * row["time/rollout"]))  # a count: undo float error
        train_tokens = sink["train_tokens"]
        members[name] = {
            "params": n,
            "rollout_tokens": gen_tokens,
            "rollout_s": row["time/rollout"],
            "rollout_tokens_per_s": gen_tokens / row["time/rollout"],
            "rollout_tflops": 2 * n * gen_tokens / row["time/rollout"] / 1e12,
            "rollout_mfu": 2 * n * gen_tokens / row["time/rollout"] / 1e12 / rate,
            "train_tokens": train_tokens,
            "train_s": row["time/train"],
            "train_tokens_per_s": train_tokens / row["time/train"],
            "train_tflops": 6 * n * train_tokens / row["time/train"] / 1e12,
            "train_mfu": 6 * n * train_tokens / row["time/train"] / 1e12 / rate,
            "graft_s": row.get("time/graft", float("nan")),
            "verify_s": row["time/verify"],
            "member_step_s": row["time/step"],
            "peer_groups_received": row.get("graft/replaced", 0.0),
            "mean_response_tokens": row["completions/mean_length"],
        }
    return {"backend": backend, "setup_s": setup_s, "warmup_step_s": warmup_s, "cotrain_step_s": step_s,
            "peak_gpu_memory_gib": peak, "members": members}


# ----- vLLM backend checks ---------------------------------------------------------------------

VLLM_CHECKS = ("engine_path", "logprobs_vs_teacher_forced", "weight_sync", "finish_reasons_at_cap",
               "seeded_reproducibility", "processed_logprobs_t0.7", "memory_handover")
# fp32 engine and trainer on the same GPU: kernels differ (paged attention vs eager), so the
# log-probs agree to about 1e-4; 2e-3 leaves room and still catches a wrong distribution
# (temperature, stale weights), which is off by 1e-1 or more.
LOGPROB_TOLERANCE = 2e-3


def max_logprob_gap(model: Any, tok: Any, completions: list[Any], device: torch.device,
                    temperature: float = 1.0) -> float:
    """Largest |recorded - teacher-forced| per-token log-prob over `completions` under `model`."""
    from graft_fed.modeling import pack, response_forward

    batch = pack([c.prompt_token_ids for c in completions], [c.token_ids for c in completions],
                 tok.pad_token_id, device)
    with torch.no_grad():
        want = response_forward(model, batch, temperature=temperature).logprobs.float().cpu()
    return max(float((torch.tensor(c.logprobs) - want[i, :len(c.token_ids)]).abs().max())
               for i, c in enumerate(completions))


def finish_reason_errors(completions: list[Any], eos_ids: list[int], cap: int) -> list[str]:
    """What is wrong with the finish reasons: "stop" exactly when the response ends in an EOS,
    "length" only at the cap."""
    errors = []
    for i, c in enumerate(completions):
        ends_in_eos = bool(c.token_ids) and c.token_ids[-1] in eos_ids
        if (c.finish_reason == "stop") != ends_in_eos:
            errors.append(f"response {i}: {c.finish_reason!r} but last token {c.token_ids[-1:]} (EOS ids {eos_ids})")
        elif c.finish_reason == "length" and len(c.token_ids) != cap:
            errors.append(f"response {i}: 'length' after {len(c.token_ids)} tokens, cap {cap}")
    return errors


def vllm_checks(device: torch.device, model_spec: str = "zoo:tiny-llama-char",
                log: Any = print) -> dict[str, Any]:
    """The first-GPU-run checks of the vLLM backend (see the module docstring, step 6).
    Returns {"skipped": why} when vllm or a CUDA device is missing, else one entry per check
    with "ok" and what was measured."""
    from graft_fed.errors import ConfigError
    from graft_fed.modeling import load_model_and_tokenizer
    from graft_fed.rollout import vllm as vb
    from graft_fed.rollout.base import SamplingParams
    from graft_fed.trainer.config import VllmSection
    from graft_fed.zoo import resolve_model_path

    try:
        vb.import_vllm()
        vb.require_cuda(device)
    except ConfigError as exc:
        return {"skipped": str(exc), "not_run": list(VLLM_CHECKS)}
    path = resolve_model_path(model_spec)
    model, tok = load_model_and_tokenizer(path, device)
    model.eval()
    opts = VllmSection(gpu_memory_utilization=0.2, dtype="fp32", enforce_eager=True, max_model_len=256)
    t0 = time.perf_counter()
    engine = vb.build_vllm_engine(path, tok, model, opts, seed=0, add_special_tokens=False, device=device)
    checks: dict[str, Any] = {"model": model_spec, "engine_start_s": time.perf_counter() - t0}
    prompts = ["Q: What is 12 + 7?\nA: ", "Q: What is 3 * 4?\nA: ", "Q: What is 9 - 5?\nA: "]
    sp = SamplingParams(n=4, max_new_tokens=48)
    flat = lambda groups: [c for g in groups for c in g]  # noqa: E731

    def run(name: str, fn: Any) -> None:
        try:
            checks[name] = fn()
        except Exception as exc:  # a failed check is reported, and the others still run
            checks[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(f"vLLM check {name}: {'ok' if checks[name].get('ok') else 'NOT OK'} {checks[name]}")

    def engine_path() -> dict[str, Any]:
        kind, _ = vb._engine_model(engine.llm)
        return {"ok": kind in ("local", "rpc"), "path": kind}

    def logprobs() -> dict[str, Any]:
        gap = max_logprob_gap(model, tok, flat(engine.generate(prompts, sp)), device)
        return {"ok": gap < LOGPROB_TOLERANCE, "max_abs_gap": gap}

    def weight_sync() -> dict[str, Any]:
        import copy

        before = copy.deepcopy(model)
        gaps, gaps_old = [], []
        for factor in (1.5, 0.8):  # two syncs: the second rollout after a sync is the one that broke
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(factor)
            engine.sync_weights(model)
            done = flat(engine.generate(prompts, sp))
            gaps.append(max_logprob_gap(model, tok, done, device))
            gaps_old.append(max_logprob_gap(before, tok, done, device))
        del before
        return {"ok": max(gaps) < LOGPROB_TOLERANCE and min(gaps_old) > 10 * LOGPROB_TOLERANCE,
                "max_abs_gap_new_weights": gaps, "max_abs_gap_old_weights": gaps_old,
                "weight_sync_s": engine.timings.get("weight_sync")}

    def finish_reasons() -> dict[str, Any]:
        cap = 6
        short = SamplingParams(n=16, max_new_tokens=cap)
        done = flat(engine.generate(prompts, short))
        # what the installed vLLM itself says for an EOS at the cap (0.10.2: "length")
        engine.wake()
        try:
            params = [engine.sampling_params_cls(**vb.sampling_kwargs(short, 1000 + i, engine.eos_ids))
                      for i in range(len(prompts))]
            raw = engine.llm.generate([{"prompt_token_ids": engine.encode(p)} for p in prompts], params,
                                      use_tqdm=False)
        finally:
            if engine.sleep:
                engine._sleep()
        at_cap = [o.finish_reason for r in raw for o in r.outputs
                  if len(o.token_ids) == cap and o.token_ids[-1] in engine.eos_ids]
        errors = finish_reason_errors(done, engine.eos_ids, cap)
        return {"ok": not errors, "errors": errors[:5], "stop": sum(c.finish_reason == "stop" for c in done),
                "length": sum(c.finish_reason == "length" for c in done),
                "vllm_reports_for_eos_at_cap": sorted(set(at_cap)) or "none sampled"}

    def reproducibility() -> dict[str, Any]:
        state = engine.rng_state()
        ids = lambda groups: [c.token_ids for c in flat(groups)]  # noqa: E731
        first = ids(engine.generate(prompts, sp))
        engine.set_rng_state(state)
        resumed = ids(engine.generate(prompts, sp))
        keyed = [ids(engine.generate(prompts, sp, seeds=[5, 6, 7])) for _ in range(2)]
        return {"ok": first == resumed and keyed[0] == keyed[1], "resumed_identical": first == resumed,
                "keyed_identical": keyed[0] == keyed[1]}

    def processed() -> dict[str, Any]:
        warm = SamplingParams(n=4, temperature=0.7, max_new_tokens=48)
        done = flat(engine.generate(prompts, warm))
        gap = max_logprob_gap(model, tok, done, device, temperature=0.7)
        untempered = max_logprob_gap(model, tok, done, device, temperature=1.0)
        return {"ok": gap < LOGPROB_TOLERANCE and untempered > 10 * LOGPROB_TOLERANCE,
                "logprobs_mode": engine.logprobs_mode, "max_abs_gap_t0.7": gap, "max_abs_gap_t1": untempered}

    def memory_handover() -> dict[str, Any]:
        # The trainer's turn: fill what the sleeping engine left free, free it into PyTorch's
        # cache (as an optimiser step's temporaries are), then the engine must wake and sample.
        free, total = torch.cuda.mem_get_info(device)
        block = max(0, free - int(0.1 * total))  # less than the engine's 0.2 stays free
        x = torch.empty(block, dtype=torch.uint8, device=device)
        del x
        cached = torch.cuda.memory_reserved(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        engine.sync_weights(model)
        engine.generate(prompts, sp)
        return {"ok": True, "trainer_block_gib": block / 2**30, "cached_before_wake_gib": cached / 2**30,
                "free_before_wake_gib": free_before / 2**30, "engine_share": opts.gpu_memory_utilization,
                "total_gib": total / 2**30}

    for name, fn in zip(VLLM_CHECKS, (engine_path, logprobs, weight_sync, finish_reasons, reproducibility,
                                      processed, memory_handover)):
        if name == "memory_handover" and device.type != "cuda":
            checks[name] = {"ok": None, "skipped": "needs a CUDA device"}
            continue
        run(name, fn)
    closer = getattr(engine.llm, "shutdown", None)
    del engine
    if callable(closer):
        closer()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return checks


def vllm_checks_table(checks: dict[str, Any]) -> str:
    if "skipped" in checks:
        return (f"vLLM checks NOT RUN ({checks['skipped']}): " + ", ".join(checks["not_run"]))
    lines = ["| vLLM check | result |", "|---|---|"]
    for name in VLLM_CHECKS:
        c = checks.get(name, {})
        result = "skipped: " + c["skipped"] if "skipped" in c else ("ok" if c.get("ok") else "NOT OK")
        lines.append(f"| {name} | {result} |")
    return "\n".join(lines)


def hardware(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def table(result: dict[str, Any]) -> str:
    lines = [f"bf16 matmul: {result['matmul']['tflops']:.1f} TFLOP/s ({result['matmul']['size']}^3, "
             f"{result['hardware'].get('gpu', result['hardware']['device'])})",
             "| backend | model | params (M) | rollout tok/s | rollout MFU | train tok/s | train MFU | graft s | step s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        if "members" not in run:
            lines.append(f"| {run['backend']} | {run.get('skipped', '')} | | | | | | | |")
            continue
        for name, m in run["members"].items():
            lines.append(f"| {run['backend']} | {name} | {m['params'] / 1e6:,.1f} | {m['rollout_tokens_per_s']:,.0f} | "
                         f"{m['rollout_mfu']:.1%} | {m['train_tokens_per_s']:,.0f} | {m['train_mfu']:.1%} | "
                         f"{m['graft_s']:.2f} | {m['member_step_s']:.1f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the logic in seconds")
    ap.add_argument("--out", default="runs/gpu_check", help="working directory (models, JSON)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16; tiny 8)")
    ap.add_argument("--n", type=int, default=None, help="responses per prompt (default 8; tiny 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response cap (default 256; tiny 8)")
    # 16 ran out of the H200's 140 GiB (two fp32 models with AdamW in one process, no
    # activation checkpointing); 4 peaked at 94.5 GiB (bench/results/gpu/, 2026-12-04).
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward micro-batch")
    ap.add_argument("--matmul-size", type=int, default=None, help="default 8192; tiny 128")
    ap.add_argument("--matmul-seconds", type=float, default=None, help="default 5; tiny 0.05")
    ap.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                    help="also time the vLLM backend: auto = when vllm is importable on a GPU")
    ap.add_argument("--vllm-memory", type=float, default=0.2, help="rollout.vllm.gpu_memory_utilization per engine")
    ap.add_argument("--budget-s", type=float, default=450, help="skip the vLLM part when past this share of time")
    ap.add_argument("--vllm-checks", choices=("auto", "off"), default="auto",
                    help="the vLLM backend's first-run checks (step 6): auto = run where vllm and a GPU are")
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    defaults = dict(prompts=(8, 16), n=(4, 8), max_new_tokens=(8, 256), matmul_size=(128, 8192),
                    matmul_seconds=(0.05, 5.0))
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    try:
        return _main(parse_args(argv))
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible; run with --tiny for the CPU check of the logic")
    if args.tiny:
        torch.set_num_threads(1)  # toy tensors: more threads only contend
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731

    # Correctness before speed: the vLLM checks first, on a tiny model (a minute or two).
    if args.vllm_checks == "off":
        checks: dict[str, Any] = {"skipped": "--vllm-checks off", "not_run": list(VLLM_CHECKS)}
    else:
        checks = vllm_checks(device, log=log)
    print(vllm_checks_table(checks), flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    rate_info = matmul_rate(device, args.matmul_size, args.matmul_seconds)
    log(f"bf16 matmul {rate_info['tflops']:.1f} TFLOP/s")
    words = prompt_words()
    models, n_params = {}, {}
    for seed, name in enumerate(ARCHS):
        models[name] = out / "models" / name
        n_params[name] = build_model(models[name], name, args.tiny, device, words, seed)
        log(f"built {name}: {n_params[name] / 1e9:.3f} B parameters")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    runs = [run_backend("hf", models, n_params, rate_info["tflops"], args, out, log)]
    log(f"transformers backend: co-training step {runs[0]['cotrain_step_s']:.1f} s")
    vllm_reason = None
    if args.vllm == "off":
        vllm_reason = "--vllm off"
    elif device.type != "cuda":
        vllm_reason = "needs a CUDA device"
    else:
        try:
            import vllm  # noqa: F401
        except ImportError:
            vllm_reason = "vllm is not installed"
        if vllm_reason and args.vllm == "on":
            raise SystemExit(f"--vllm on: {vllm_reason}")
        if not vllm_reason and time.perf_counter() - start > args.budget_s / 2:
            vllm_reason = f"time budget: {time.perf_counter() - start:.0f} s already spent of {args.budget_s:.0f}"
    if vllm_reason:
        runs.append({"backend": "vllm", "skipped": vllm_reason})
        log(f"vLLM backend skipped: {vllm_reason}")
    else:
        runs.append(run_backend("vllm", models, n_params, rate_info["tflops"], args, out, log))
        log(f"vLLM backend: co-training step {runs[1]['cotrain_step_s']:.1f} s")

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": args.tiny,
        "hardware": hardware(device),
        "matmul": rate_info,
        "settings": {"prompts_per_step": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                     "micro_batch_size": args.micro_batch, "num_minibatches": 2, "precision": "auto",
                     "archs": {k: arch_config(k, args.tiny) for k in ARCHS}},
        "runs": runs,
        "vllm_checks": checks,
        "total_s": time.perf_counter() - start,
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=_json_default), encoding="utf-8")
    print(table(result))
    print(vllm_checks_table(checks))
    log(f"wrote {out / 'gpu_check.json'}")
    return result


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


if __name__ == "__main__":
    main()

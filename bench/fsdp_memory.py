"""What one process of a torchrun (FSDP2) run holds: measured, not computed.

    torchrun --nproc-per-node K bench/fsdp_memory.py [--model zoo:tiny-llama-char] [--bf16]

Shards the model as `graft-fed train` does under torchrun (graft_fed/trainer/distributed.py),
runs one forward/backward/AdamW step on a random batch, then counts the bytes of the
tensors each process keeps between steps: its parameter shards, gradient shards and AdamW
state, and the full weights it gathers for a rollout. Runs on CPU (gloo) or CUDA (nccl).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo:tiny-llama-char")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (MixedPrecisionPolicy)")
    args = ap.parse_args()

    from graft_fed.modeling import load_model_and_tokenizer
    from graft_fed.trainer.config import load_train_config
    from graft_fed.trainer.distributed import end_process, full_weights, init_distributed, shard_model

    cfg = load_train_config(None, {"run.device": "auto"})
    ctx = init_distributed(cfg)
    model, _ = load_model_and_tokenizer(args.model, "cpu")
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, ctx, bf16=args.bf16, activation_checkpointing=False, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=ctx.device)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    params = local_bytes(model.parameters())
    grads = local_bytes(p.grad for p in model.parameters())
    adam = local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    with full_weights(model, reshard_after_forward=True):
        gathered = sum(p.numel() * p.element_size() for p in model.parameters())
    row = torch.tensor([params, grads, adam, gathered], dtype=torch.float64, device=ctx.device)
    rows = [torch.zeros_like(row) for _ in range(ctx.world_size)]
    dist.all_gather(rows, row)
    if ctx.is_main:
        print(f"{args.model}: {n_params:,} parameters, {ctx.world_size} processes ({ctx.backend}), "
              f"bf16 {args.bf16}")
        print(f"{'process':>7} {'param shards':>13} {'grad shards':>12} {'AdamW state':>12} {'total':>12} "
              f"{'rollout gather':>15}")
        for r, (p, g, a, f) in enumerate(t.tolist() for t in rows):
            print(f"{r:>7} {p:>13,.0f} {g:>12,.0f} {a:>12,.0f} {p + g + a:>12,.0f} {f:>15,.0f}")
        print("bytes; 'rollout gather' is held only while the process samples (full_weights)")
    dist.barrier()
    dist.destroy_process_group()
    # as the CLI ends a torchrun process: a gloo worker thread still dropping the last
    # all-gather's tensors during interpreter finalisation aborts a run that succeeded
    end_process(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""The per-model training loop (GRPO, and GRAFT on top of it), checkpoints and metrics."""

#!/usr/bin/env bash
# GPU check (issue 6): one full GRAFT co-training step of two randomly initialised models
# with the real architectures of Qwen3-1.7B and Llama-3.2-1B, transformers rollouts (and
# vLLM's when vllm is installed), reporting rollout / training tokens/s and MFU against a
# bf16 matmul rate measured in the same run. Sized for under 8 minutes on one H200, offline.
#
#   bash bench/gpu_check.sh                      # writes runs/gpu_check/gpu_check.json
#   bash bench/gpu_check.sh --vllm off --out X   # any bench/gpu_check.py option
#
# Record the printed table with the date and hardware in docs/performance.md (GPU section).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
git rev-parse --short HEAD 2>/dev/null || true
# Hard stop at 9 minutes; the script itself skips the vLLM part when short of time.
exec timeout 540 "$PY" bench/gpu_check.py "$@"

#!/usr/bin/env bash
# GPU check (issues 6 and 16). First the vLLM backend's first-run checks (issue 16; a
# minute or two on a tiny model): engine path, log-probs against a teacher-forced pass,
# weights synced twice and the log-probs following, finish reasons at the length cap, seeded
# reproducibility, processed log-probs at T = 0.7, the memory hand-over between trainer and
# engine. Each prints ok / NOT OK, and where vllm or a GPU is missing the script says which
# checks did not run and why. Then one full GRAFT co-training step of two randomly
# initialised models with the real architectures of Qwen3-1.7B and Llama-3.2-1B,
# transformers rollouts (and vLLM's when vllm is installed and time is left), reporting
# rollout / training tokens/s and MFU against a bf16 matmul rate measured in the same run.
# Under 9 minutes on one H200 (hard stop below), offline.
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
"$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not installed (the vLLM checks will not run)"
# Hard stop at 9 minutes; the script itself skips the vLLM part when short of time.
exec timeout 540 "$PY" bench/gpu_check.py "$@"

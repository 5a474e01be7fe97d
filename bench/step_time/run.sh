#!/usr/bin/env bash
# Seconds per GRPO training step, graft-fed vs TRL, side by side in one command:
#
#   bash bench/step_time/run.sh [--rounds R] [--steps W] [--warmup K] [--model zoo:NAME|DIR]
#
# 1. sets up bench/step_time/.venv-trl (CPU torch 2.13.0, pinned TRL, graft-fed editable;
#    TRL lives only there, never in graft-fed's dependencies);
# 2. runs R rounds, each one graft-fed run and one TRL run in alternating order
#    (G T, T G, G T, ...) so that machine noise falls on both; every run loads the model,
#    does K untimed warm-up steps, then times W steps;
# 3. pools the timed steps into bench/step_time/results/step_time.{json,md} and prints the table.
#
# Both sides run with .venv-trl's interpreter (one torch/transformers for both) on the
# checkout's graft_fed. Defaults (4 rounds x (1 warm-up + 5 timed) steps per framework)
# take about 4 minutes on a 2-core CPU with the zoo model.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ROUNDS=4 STEPS=5 WARMUP=1 MODEL=zoo:tiny-llama-char
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds R] [--steps W] [--warmup K] [--model zoo:NAME|DIR]" >&2; exit 2 ;;
  esac
done

bash "$HERE/setup_venv.sh"
PY="$HERE/.venv-trl/bin/python"
RUNS="$HERE/work/runs"
rm -rf "$RUNS" && mkdir -p "$RUNS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2

loads="$(cut -d' ' -f1-3 /proc/loadavg)"
run_one() {  # framework round
  local fw=$1 r=$2 script
  [ "$fw" = graft-fed ] && script=graft_step.py || script=trl_step.py
  echo "== round $r/$ROUNDS: $fw" >&2
  (cd "$ROOT" && "$PY" "$HERE/$script" --out "$RUNS/r${r}-${fw}.json" --warmup "$WARMUP" --steps "$STEPS" --model "$MODEL") \
    > "$RUNS/r${r}-${fw}.log" 2>&1 || { tail -40 "$RUNS/r${r}-${fw}.log" >&2; exit 1; }
  grep "median of" "$RUNS/r${r}-${fw}.log" >&2 || true
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then run_one graft-fed "$r"; run_one trl "$r"
  else run_one trl "$r"; run_one graft-fed "$r"; fi
  loads="$loads; $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$PY" "$HERE/report.py" --runs "$RUNS" --out "$HERE/results/step_time" \
  --command "bash bench/step_time/run.sh --rounds $ROUNDS --steps $STEPS --warmup $WARMUP --model $MODEL" --load "$loads"

#!/usr/bin/env bash
# Seconds per GRPO training step, graft-fed vs TRL, side by side in one command:
#
#   bash bench/step_time/run.sh [--rounds R] [--steps W] [--warmup K] [--threads T] [--model zoo:NAME|DIR]
#
# 1. sets up bench/step_time/.venv-trl (CPU torch 2.13.0, pinned TRL, graft-fed editable;
#    TRL lives only there, never in graft-fed's dependencies);
# 2. runs R rounds; each round is one fresh process (interleave.py) that builds both trainers
#    and alternates them step by step (graft-fed step, TRL step, graft-fed step, ...; TRL
#    first in even rounds), K untimed warm-up steps then W timed steps each, so that
#    whatever else the machine does falls on both alike;
# 3. pools the timed steps into bench/step_time/results/step_time.{json,md} and prints the table.
#
# Both sides run with .venv-trl's interpreter (one torch/transformers for both) on this
# checkout's graft_fed. Defaults (4 rounds x (1 + 5) steps per framework, 1 torch thread)
# take about 5 minutes on a 2-core CPU with the zoo model.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ROUNDS=4 STEPS=5 WARMUP=1 THREADS=1 MODEL=zoo:tiny-llama-char
usage="usage: $0 [--rounds R] [--steps W] [--warmup K] [--threads T] [--model zoo:NAME|DIR]"
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done

bash "$HERE/setup_venv.sh"
PY="$HERE/.venv-trl/bin/python"
RUNS="$HERE/work/runs"
rm -rf "$RUNS" && mkdir -p "$RUNS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export STEP_TIME_THREADS=$THREADS

loads="$(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  first=graft-fed; [ $((r % 2)) -eq 0 ] && first=trl
  echo "== round $r/$ROUNDS ($first first)" >&2
  (cd "$ROOT" && "$PY" "$HERE/interleave.py" --out-dir "$RUNS" --tag "r$r" --first "$first" \
      --warmup "$WARMUP" --steps "$STEPS" --model "$MODEL") > "$RUNS/r$r.log" 2>&1 \
    || { tail -40 "$RUNS/r$r.log" >&2; exit 1; }
  grep "median of" "$RUNS/r$r.log" >&2 || true
  loads="$loads; $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$PY" "$HERE/report.py" --runs "$RUNS" --out "$HERE/results/step_time" --load "$loads" \
  --command "bash bench/step_time/run.sh --rounds $ROUNDS --steps $STEPS --warmup $WARMUP --threads $THREADS --model $MODEL"

#!/usr/bin/env bash
# README command 1: set up .venv, then run the main job on the embedded default: a broker
# and the three zoo models as separate node processes over loopback gRPC, helping one
# another (graft-fed sim). Extra arguments go to `graft-fed sim` (e.g. --nodes 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# a sim never continues an earlier one in its folder: keep the last quickstart's runs/sim aside
case " $* " in
  *" --output-dir"*) ;;
  *) if [ -e runs/sim ]; then
       kept="runs/sim.$(date +%Y%m%d-%H%M%S)"
       mv runs/sim "$kept"
       echo "the previous runs/sim is now $kept"
     fi ;;
esac
.venv/bin/graft-fed sim --nodes 3 --config configs/sim-zoo.yaml "$@"
for node in llama gpt2 qwen3; do
  [ -f "runs/sim/$node/metrics.jsonl" ] && .venv/bin/graft-fed plot "runs/sim/$node" >/dev/null
done
echo "per-node runs, metrics and plots: runs/sim/<node>/ ; result table: runs/sim/result.md"

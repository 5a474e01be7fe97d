#!/usr/bin/env bash
# Broker benchmarks: ingest + match latency, bundle throughput, many small uploads at once,
# federation share of step time, and the load run (64 nodes x 256 summaries over mutual TLS with a broker restart).
# Results (JSON + Markdown) go to bench/broker/results/. Run from anywhere:
#   bench/broker/run.sh            # default grids (~5 min each on a 2-core machine) + 600 s of load
#   bench/broker/run.sh --quick    # tiny grids and 60 s of load (about 4-5 minutes in all)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
QUICK=()
if [[ "${1:-}" == "--quick" ]]; then QUICK=(--quick); fi
echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%FT%TZ)"
"$PY" bench/broker/ingest_match.py "${QUICK[@]}"
"$PY" bench/broker/bundle_throughput.py "${QUICK[@]}"
"$PY" bench/broker/upload_rate.py "${QUICK[@]}"
"$PY" bench/broker/sim_share.py "${QUICK[@]}"
if [[ ${#QUICK[@]} -gt 0 ]]; then
  "$PY" bench/broker/load.py --duration 60 --name load_quick
else
  "$PY" bench/broker/load.py            # 64 nodes x 256 summaries, 600 s, restart at 300 s
fi
echo "== results in bench/broker/results/"

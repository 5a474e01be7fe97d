#!/usr/bin/env bash
# Broker benchmarks: ingest + match latency, bundle throughput, federation share of step time.
# Results (JSON + Markdown) go to bench/broker/results/. Run from anywhere:
#   bench/broker/run.sh            # default grids (~5 min each on a 2-core machine)
#   bench/broker/run.sh --quick    # tiny grids (about 2-3 minutes in all)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
QUICK=()
if [[ "${1:-}" == "--quick" ]]; then QUICK=(--quick); fi
echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%FT%TZ)"
"$PY" bench/broker/ingest_match.py "${QUICK[@]}"
"$PY" bench/broker/bundle_throughput.py "${QUICK[@]}"
"$PY" bench/broker/sim_share.py "${QUICK[@]}"
echo "== results in bench/broker/results/"

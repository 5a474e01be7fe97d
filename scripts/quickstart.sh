#!/usr/bin/env bash
# README command 1: set up .venv and run the main job on the embedded default.
# Extra arguments go to `graft-fed train` (e.g. --set run.steps=10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/graft-fed train --config configs/tiny-grpo.yaml "$@"
.venv/bin/graft-fed plot runs/tiny-grpo

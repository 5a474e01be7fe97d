#!/usr/bin/env bash
# The test command: set up .venv with the test tools if needed, then run the suite.
# Extra arguments go to pytest. Exit code 5 (no tests collected) is a failure here:
# a suite that runs nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"

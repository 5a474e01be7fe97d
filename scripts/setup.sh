#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install graft-fed.
#   scripts/setup.sh          runtime install
#   scripts/setup.sh --dev    plus the test tools
# PyTorch first: a CPU build on machines without an NVIDIA GPU (never the multi-GB CUDA
# wheel), the default CUDA build where `nvidia-smi` sees a GPU. Then the project, whose
# torch range the installed build already satisfies, so nothing is re-downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GRAFT_FED_VENV:-.venv}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_() { "$VENV/bin/python" -m pip "$@"; }
pip_ install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the default (CUDA) PyTorch build"
    pip_ install -q "torch>=2.4,<3"
  else
    echo "setup: no NVIDIA GPU: installing the CPU build of PyTorch 2.13.0"
    # torch alone from PyTorch's CPU index (it outranks PyPI's CUDA wheel of the same
    # version); few retries, so a machine that cannot reach that index (a local wheel
    # cache, a mirror) moves on quickly. Then its dependencies from the usual index.
    pip_ install -q --no-deps --retries 1 --timeout 15 "torch==2.13.0" \
      --extra-index-url https://download.pytorch.org/whl/cpu
    pip_ install -q "torch==2.13.0"
  fi
fi
pip_ install -q -e ".${extras}"
if [ -n "$extras" ] && ! command -v chromium >/dev/null 2>&1 && [ -z "${GRAFT_FED_CHROMIUM:-}" ]; then
  # tests/test_live_page.py renders the broker's live page in a real headless browser
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the live page's browser test"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
      echo "setup: WARNING: could not install chromium; tests/test_live_page.py will FAIL (not skip)" >&2
    fi
  else
    echo "setup: WARNING: no chromium and no way to install it here (needs root and apt-get);" \
         "tests/test_live_page.py will FAIL: install chromium, set GRAFT_FED_CHROMIUM=/path/to/browser," \
         "or skip it on purpose with GRAFT_FED_SKIP_BROWSER=1" >&2
  fi
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import torch, graft_fed; print("graft-fed", graft_fed.__version__, "torch", torch.__version__)'))"

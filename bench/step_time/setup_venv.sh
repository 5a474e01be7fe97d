#!/usr/bin/env bash
# Create bench/step_time/.venv-trl: PyTorch's CPU build first (never the CUDA wheel), then the
# pinned TRL and what it needs, then graft-fed itself (editable, from the repo root).
# TRL is installed ONLY here; it is never a dependency of graft-fed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv-trl"
PY=${PYTHON:-python3}
TRL_VERSION=${TRL_VERSION:-1.16.0}
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_() { "$VENV/bin/python" -m pip "$@"; }
have() { "$VENV/bin/python" - "$@" <<'PY' >/dev/null 2>&1
import sys, importlib.metadata as md
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    got = md.version(name)
    if got.split("+")[0] != want:
        sys.exit(1)
PY
}
if ! have "torch==$TORCH_VERSION"; then
  echo "setup: installing the CPU build of torch $TORCH_VERSION into $VENV"
  # Pinned to the +cpu local version, so pip can never fall back to the multi-GB CUDA wheel:
  # a wheel already on disk (pip's find-links) first, else PyTorch's CPU index.
  pip_ install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    pip_ install -q "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
if ! have "trl==$TRL_VERSION"; then
  echo "setup: installing trl==$TRL_VERSION (and accelerate, datasets) into $VENV"
  pip_ install -q "trl==$TRL_VERSION" "torch==$TORCH_VERSION+cpu"
fi
# Ask the venv's package metadata, from outside the repo: `import graft_fed` from the repo root
# finds the source folder through the current directory and would skip the install (and
# with it math-verify, which the first round needs).
if ! (cd / && "$VENV/bin/python" -c "import importlib.metadata as m; m.version('graft-fed'); m.version('math-verify')") >/dev/null 2>&1; then
  echo "setup: installing graft-fed (editable) into $VENV"
  pip_ install -q -e "$ROOT" "torch==$TORCH_VERSION+cpu"
fi
(cd / && "$VENV/bin/python" - <<'PY'
import torch, transformers, trl, accelerate, graft_fed
assert torch.version.cuda is None, f"expected a CPU build of torch, got CUDA {torch.version.cuda}"
print(f"setup: ready (torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, accelerate {accelerate.__version__}, graft-fed {graft_fed.__version__})")
PY
)

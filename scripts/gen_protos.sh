#!/usr/bin/env bash
# Regenerate graft_fed/proto/ from protos/. CI runs `scripts/gen_protos.sh --check`, which
# fails when the committed generated code differs from what this script produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=graft_fed/proto
check=0
[ "${1:-}" = "--check" ] && check=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  protos/graft_fed/v1/*.proto
# protoc writes graft_fed/v1/...: flatten into graft_fed/proto/ and make imports package-relative.
mkdir -p "$tmp/flat"
for f in "$tmp"/graft_fed/v1/*.py "$tmp"/graft_fed/v1/*.pyi; do
  sed -e 's/^from graft_fed\.v1 import \(.*\)_pb2 as/from graft_fed.proto import \1_pb2 as/' "$f" > "$tmp/flat/$(basename "$f")"
done
cat > "$tmp/flat/__init__.py" <<'PYEOF'
"""Generated gRPC/protobuf code for graft_fed.v1 (scripts/gen_protos.sh). Do not edit.

Only the serialisation module, the broker servicer and the node client import it."""
PYEOF
if [ "$check" = 1 ]; then
  if ! diff -ru "$tmp/flat" "$out" >/dev/null; then
    diff -ru "$tmp/flat" "$out" | head -40
    echo "gen_protos: graft_fed/proto is stale: run scripts/gen_protos.sh and commit the result" >&2
    exit 1
  fi
  echo "gen_protos: generated code is current"
else
  rm -rf "$out"
  mkdir -p "$out"
  cp "$tmp"/flat/* "$out"/
  echo "gen_protos: wrote $out"
fi

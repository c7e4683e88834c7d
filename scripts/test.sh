#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine with Rust: installs the native
# packages and the local Kafka-protocol broker (Tansu) when missing, builds the
# service binaries the end-to-end tests start, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake libclang-dev libcurl4-openssl-dev librocksdb-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

TANSU_ROOT="${TALLY_TANSU_ROOT:-$HOME/.cache/tally/tansu-0.6.0}"
if [ ! -x "$TANSU_ROOT/bin/tansu" ]; then
  echo "==> installing Tansu 0.6.0 into $TANSU_ROOT (once per machine, ~16-25 min on 2 cores)"
  cargo install tansu --version 0.6.0 --locked --features libsql --root "$TANSU_ROOT"
fi
export TALLY_TANSU_ROOT="$TANSU_ROOT"

echo "==> building"
cargo build --workspace --bins --tests
echo "==> testing"
log="$(mktemp)"
status=0
cargo test --workspace -- --test-threads=2 2>&1 | tee "$log" || status=$?
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
rm -f "$log"
exit "$status"

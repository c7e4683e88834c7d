#!/usr/bin/env bash
# `tally up` on a fresh Debian 12 machine with Rust: installs the native packages when
# missing, builds every shipped binary (tally up runs each service as its own process) and
# starts the pipeline. Arguments are passed to `tally up`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
install_native_packages
cargo build --release --workspace --bins --exclude tally-bench
exec target/release/tally up "$@"

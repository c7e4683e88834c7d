#!/usr/bin/env bash
# `tally up` on a fresh Debian 12 machine with Rust: installs the native packages when
# missing, builds every shipped binary (tally up runs each service as its own process) and
# starts the pipeline. Arguments are passed to `tally up`.
#
# The build is the one BENCHMARKS.md measures and the image ships: release, with RocksDB
# compiled from source (Debian's library has its assertions on and runs the counters at up
# to half the speed), in target/compiled, with the same command as the benchmarks (the
# whole workspace: one set of features, so neither rebuilds the other's crates). The first
# build compiles RocksDB's C++ once; later ones reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
# sqlite3: the local broker's database is indexed with it (shared/src/local_broker.rs).
install_native_packages sqlite3
export CARGO_TARGET_DIR=target/compiled
if [ ! -x "$CARGO_TARGET_DIR/release/tally" ]; then
  echo "==> first build: compiling RocksDB from source into $CARGO_TARGET_DIR (about 13 min on 2 cores, once)"
fi
ROCKSDB_COMPILE=1 cargo build --release --workspace --bins
exec "$CARGO_TARGET_DIR/release/tally" up "$@"

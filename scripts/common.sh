# Shared by scripts/test.sh and scripts/up.sh: the native packages a build needs.
# Sourced, not run.

# Installs the Debian packages RocksDB and librdkafka (TLS, SASL, gzip, zstd) build
# against, when missing; more packages (e.g. test tools) may be passed as arguments.
install_native_packages() {
  local packages=(cmake pkg-config libclang-dev libcurl4-openssl-dev librocksdb-dev libsnappy-dev libssl-dev libsasl2-dev zlib1g-dev libzstd-dev "$@") missing=() p
  for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "==> installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

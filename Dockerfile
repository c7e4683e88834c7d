# One image with every tally binary; each container runs one of them
# (docker-compose.yml, helm/tally).
#
# Build and push, tagged with the version (the Helm chart's appVersion is its default tag):
#   docker build -t <registry>/tally:<version> .
#   docker push <registry>/tally:<version>
#   helm install tally helm/tally --set image.repository=<registry>/tally --set kafka.bootstrapServers=…
#
# It runs as the numeric user 10001:10001 (Kubernetes' runAsNonRoot can check it; the
# chart's securityContext says the same) and makes the data directories it owns, so
# named volumes mounted on them are writable.
FROM rust:1-bookworm AS build
# The packages scripts/common.sh builds with: RocksDB's headers and Snappy, and
# librdkafka with TLS (OpenSSL), SASL (Cyrus, for GSSAPI), zlib and zstd.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake pkg-config libclang-dev libcurl4-openssl-dev librocksdb-dev \
      libsnappy-dev libssl-dev libsasl2-dev zlib1g-dev libzstd-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# RocksDB is compiled from source (optimized, no assertions; 9-13 min more on 2 cores)
# rather than linked against Debian's library, which is built with its assertions on
# and runs the counter's hot paths at about half the speed (BENCHMARKS.md).
# The shipped binaries only: the benchmarks (`tally-bench`) stay out.
RUN ROCKSDB_COMPILE=1 cargo build --release --workspace --bins --exclude tally-bench \
 && mkdir /out \
 && cp target/release/tally target/release/tally-ingester target/release/tally-counter \
       target/release/tally-graph target/release/tally-query target/release/tally-broker \
       target/release/tally-worker target/release/tally-rollups-consumer /out/

FROM debian:bookworm-slim
# The libraries the binaries load: the C++ runtime and Snappy (RocksDB is linked in),
# OpenSSL, Cyrus SASL (with its PLAIN/SCRAM and GSSAPI mechanisms), zstd, zlib, curl;
# and the CA certificates for TLS.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libstdc++6 libsnappy1v5 libssl3 libsasl2-2 \
      libsasl2-modules libsasl2-modules-gssapi-mit libzstd1 zlib1g libcurl4 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tally \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tally --shell /usr/sbin/nologin tally \
 && mkdir -p /var/lib/tally/counter /var/lib/tally/graph /etc/tally \
 && chown -R 10001:10001 /var/lib/tally
COPY --from=build /out/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/tally
# Every service reads an optional $TALLY_CONFIG file and TALLY__SECTION__KEY variables.
CMD ["tally", "--help"]

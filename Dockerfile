# One image with every tally binary; each container runs one of them.
#   docker build -t tally .
FROM rust:1-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake libclang-dev libcurl4-openssl-dev librocksdb-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --workspace --bins \
 && mkdir /out \
 && cp target/release/tally target/release/tally-ingester target/release/tally-counter \
       target/release/tally-graph target/release/tally-query target/release/tally-broker \
       target/release/tally-worker /out/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends librocksdb7.8 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home /var/lib/tally tally \
 && mkdir -p /var/lib/tally && chown tally /var/lib/tally
COPY --from=build /out/ /usr/local/bin/
USER tally
WORKDIR /var/lib/tally
# Every service reads TALLY__SECTION__KEY variables (and an optional $TALLY_CONFIG file).
CMD ["tally", "--help"]

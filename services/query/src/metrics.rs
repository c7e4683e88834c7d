//! The query service's Prometheus metrics, declared once.

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, Opts, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    /// Latency per endpoint (`counter`, `series`, `batch`).
    pub request_seconds: HistogramVec,
    /// How long reads with write tokens waited for them, by `outcome`: `held`,
    /// `not_fresh_enough` (504) or `refused` (another error).
    pub token_wait_seconds: HistogramVec,
    /// Per shard, how stale its counts are as tally-query last heard ([`crate::standbys`]).
    pub shard_staleness_seconds: GaugeVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let buckets = vec![0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0];
        Self {
            request_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_query_request_seconds",
                        "Read latency per endpoint (counter, series, batch, contributors), waits for write tokens \
                         included: rising, if tally_query_token_wait_seconds rose too, reads wait for fresh writes; \
                         else look at the counters (their apply time and lag)",
                    )
                    .buckets(buckets),
                    &["endpoint"],
                )
                .expect("valid metric"),
            ),
            token_wait_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_query_token_wait_seconds",
                        "How long reads waited for their write tokens, by outcome: held, not_fresh_enough (504 after \
                         max_wait_ms) or refused (another error). Long waits or many 504s: the ingester, graph or \
                         counters trail the writes — see their consumer lag",
                    )
                    .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0]),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
            shard_staleness_seconds: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tally_query_shard_staleness_seconds",
                        "How much newer input a shard's counts may be missing: its lag when its owner last told \
                         tally-query (every second), plus the time since — it grows while the owner is silent \
                         (paused, dead, partitioned): when it does, look at that counter's /readyz and lag",
                    ),
                    &["shard"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

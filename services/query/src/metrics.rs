//! The query service's Prometheus metrics, declared once.

use prometheus::{HistogramOpts, HistogramVec, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    /// Latency per endpoint (`counter`, `series`, `batch`).
    pub request_seconds: HistogramVec,
    /// How long reads with write tokens waited for them, by `outcome`: `held`,
    /// `not_fresh_enough` (504) or `refused` (another error).
    pub token_wait_seconds: HistogramVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let buckets = vec![0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0];
        Self {
            request_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new("tally_query_request_seconds", "Read latency per endpoint").buckets(buckets),
                    &["endpoint"],
                )
                .expect("valid metric"),
            ),
            token_wait_seconds: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_query_token_wait_seconds",
                        "How long reads waited for their write tokens",
                    )
                    .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0]),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

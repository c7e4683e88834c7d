//! The query service's Prometheus metrics, declared once.

use prometheus::{HistogramOpts, HistogramVec, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    /// Latency per endpoint (`counter`, `series`, `batch`).
    pub request_seconds: HistogramVec,
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
        }
    }
}

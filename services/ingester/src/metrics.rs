//! The ingester's Prometheus metrics, declared once.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    pub input_records: IntCounter,
    pub input_bytes: IntCounter,
    /// Payload bytes produced, by topic (shard records, graph updates, dead letters).
    pub output_bytes: IntCounterVec,
    /// Valid elements routed on, by kind (`increment`, `graph_update`).
    pub accepted: IntCounterVec,
    pub dead_letters: IntCounterVec,
    pub batch_records: Histogram,
    pub consumer_lag: IntGaugeVec,
    pub consumer_lag_seconds: prometheus::GaugeVec,
    /// 1 while the input consumer rests ([`tally_shared::rest`]).
    pub fetch_resting: IntGauge,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let metrics = Self::register(registry);
        // Every reason from 0, so the first letter of one is an increase an alert sees.
        for field in tally_core::input::REASON_FIELDS {
            metrics.dead_letters.with_label_values(&[field]);
        }
        metrics
    }

    fn register(registry: &Registry) -> Self {
        Self {
            input_records: register(
                registry,
                IntCounter::new(
                    "tally_ingester_input_records_total",
                    "Producer records consumed from the increments and graph topics: flat while \
                     tally_ingester_consumer_lag_records is above 0, ingestion stalled (see TallyIngestionStalled)",
                )
                .expect("valid metric"),
            ),
            input_bytes: register(
                registry,
                IntCounter::new("tally_ingester_input_bytes_total", "Payload bytes of the producer records consumed")
                    .expect("valid metric"),
            ),
            output_bytes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_ingester_output_bytes_total",
                        "Payload bytes produced, per topic: shard records, graph updates and dead letters",
                    ),
                    &["topic"],
                )
                .expect("valid metric"),
            ),
            accepted: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_ingester_accepted_total",
                        "Valid elements routed on, by kind: increment (to the shard topic) or graph_update (to \
                         graph-updates)",
                    ),
                    &["kind"],
                )
                .expect("valid metric"),
            ),
            dead_letters: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_ingester_dead_letters_total",
                        "Rejected elements sent to the dead-letter topic, by the field their reason names (reason: \
                         entity, metric, delta, ts, id, op, from, to; element for one not an object of known fields or \
                         lacking a required one, message for a message that is not JSON; other for a field tally does \
                         not know). Rising: a producer writes what tally refuses; each letter \
                         on tally.dead-letter says exactly why: fix the producer (nothing of a refused element was \
                         counted)",
                    ),
                    &["reason"],
                )
                .expect("valid metric"),
            ),
            batch_records: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "tally_ingester_batch_records",
                        "Input records per batch, closed at ingester.batch_max_records or batch_max_bytes (sooner when \
                         the input is read to its end): full batches mean a backlog; full while the consumer lag \
                         grows, the load exceeds the ingesters — scale their consumer group",
                    )
                    .buckets(vec![1.0, 10.0, 100.0, 1_000.0, 10_000.0, 20_000.0, 100_000.0]),
                )
                .expect("valid metric"),
            ),
            fetch_resting: register(
                registry,
                IntGauge::new(
                    "tally_ingester_fetch_resting",
                    "1 while the input consumer rests: its inputs had nothing new for 5 s, no fetches until a look at \
                     their ends (every 100 ms) finds records; normal while producers are idle",
                )
                .expect("valid metric"),
            ),
            consumer_lag_seconds: register(
                registry,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "tally_ingester_consumer_lag_seconds",
                        "How old the oldest input record not yet consumed is (0: none), per consumer group, topic and \
                         partition: over 60 s for 5 minutes fires TallyConsumerLagHigh — scale the ingesters' \
                         consumer group if the input outgrew them, read the log if their input rate fell to 0",
                    ),
                    &["group", "topic", "partition"],
                )
                .expect("valid metric"),
            ),
            consumer_lag: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "tally_ingester_consumer_lag_records",
                        "Input records not yet consumed, per topic and partition: above 0 while \
                         tally_ingester_input_records_total stays flat, the ingester is stuck (see \
                         TallyIngestionStalled)",
                    ),
                    &["topic", "partition"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

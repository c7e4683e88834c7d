//! The graph processor's Prometheus metrics, declared once.

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tally_shared::telemetry::{long_duration_histogram, register};

#[derive(Clone)]
pub struct Metrics {
    pub applied_updates: IntCounter,
    pub dropped: IntCounterVec,
    pub desc_changes: IntCounter,
    pub outbox_relayed: IntCounter,
    pub edges: IntGauge,
    pub consumer_lag: IntGauge,
    pub consumer_lag_seconds: prometheus::GaugeVec,
    /// 1 while the graph-updates partition is stopped by a failure.
    pub failed: IntGauge,
    /// Restores of the graph's store from a snapshot, and how long each took.
    pub restored: IntCounter,
    pub restore_seconds: Histogram,
    /// How long the graph took at start to catch up with the log it found.
    pub catch_up_seconds: Histogram,
    pub snapshots_taken: IntCounter,
    pub snapshot_failures: IntCounter,
    pub skipped_records: IntCounter,
    /// 1 while the graph-updates consumer rests ([`tally_shared::rest`]).
    pub fetch_resting: IntGauge,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| register(registry, IntCounter::new(name, help).expect("valid metric"));
        Self {
            applied_updates: counter(
                "tally_graph_applied_updates_total",
                "Graph updates (add_edge, remove_edge) applied to the graph's store",
            ),
            fetch_resting: register(
                registry,
                IntGauge::new(
                    "tally_graph_fetch_resting",
                    "1 while the graph-updates consumer rests: nothing new for 5 s, no fetches until a look at the \
                     log's end (every 100 ms) finds records; normal while no edges change",
                )
                .expect("valid metric"),
            ),
            failed: register(
                registry,
                IntGauge::new(
                    "tally_graph_failed_partitions",
                    "1 while the graph is stopped by a failure (/readyz says why): hierarchical totals stop following \
                     edge changes — see TallyGraphFailed (fix the cause, then tally shards skip graph)",
                )
                .expect("valid metric"),
            ),
            restored: counter("tally_graph_restored_total", "Restores of the graph's store from a snapshot"),
            restore_seconds: long_duration_histogram(
                registry,
                "tally_graph_restore_seconds",
                "Time to restore the graph's store from its newest snapshot. Long: the object store is slow or far, or \
                 the graph is large; hierarchical totals wait for the graph meanwhile",
            ),
            catch_up_seconds: long_duration_histogram(
                registry,
                "tally_graph_catch_up_seconds",
                "Time from start until the graph caught up with the log it found and served. Long: its snapshots trail \
                 far (a restore replays everything since) or it applies slowly",
            ),
            snapshots_taken: counter("tally_graph_snapshots_total", "Snapshots of the graph's store stored"),
            snapshot_failures: counter(
                "tally_graph_snapshot_failures_total",
                "Snapshots of the graph's store that failed (tried again): any in 30 minutes fires \
                 TallySnapshotsFailing — check the object store (credentials, bucket, network) in the graph's log",
            ),
            skipped_records: counter(
                "tally_graph_skipped_records_total",
                "Graph-updates records an operator skipped (tally shards skip graph) to the dead-letter topic: \
                 what they held is not applied",
            ),
            dropped: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_graph_dropped_updates_total",
                        "Graph updates dropped, by reason: duplicates (redelivered, id) and adds refused for passing \
                         graph.max_descendants (max_descendants, dead-lettered with the reason). max_descendants \
                         rising: read those letters, then fix the producer or raise graph.max_descendants",
                    ),
                    &["reason"],
                )
                .expect("valid metric"),
            ),
            desc_changes: counter(
                "tally_graph_desc_changes_total",
                "Descendant-set changes written to the outbox for the counter shards",
            ),
            outbox_relayed: counter(
                "tally_graph_outbox_relayed_total",
                "Outbox messages relayed to the shard topic: flat while tally_graph_desc_changes_total rises, \
                 relaying fails (the graph is not ready meanwhile) — its log says why",
            ),
            edges: register(registry, IntGauge::new("tally_graph_edges", "Edges in the graph").expect("valid metric")),
            consumer_lag: register(
                registry,
                IntGauge::new(
                    "tally_graph_consumer_lag_records",
                    "Graph-update records not yet applied: growing, hierarchical totals trail edge changes (see \
                     TallyConsumerLagHigh)",
                )
                .expect("valid metric"),
            ),
            consumer_lag_seconds: register(
                registry,
                prometheus::GaugeVec::new(
                    prometheus::Opts::new(
                        "tally_graph_consumer_lag_seconds",
                        "How old the oldest graph-update record not yet applied is (0: none), per consumer group and \
                         partition: over 60 s for 5 minutes fires TallyConsumerLagHigh — totals trail edge changes; \
                         a backlog drains on its own, a graph that stopped applying says why in its log",
                    ),
                    &["group", "partition"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

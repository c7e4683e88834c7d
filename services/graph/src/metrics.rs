//! The graph processor's Prometheus metrics, declared once.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tally_shared::telemetry::register;

#[derive(Clone)]
pub struct Metrics {
    pub applied_updates: IntCounter,
    pub dropped: IntCounterVec,
    pub desc_changes: IntCounter,
    pub outbox_relayed: IntCounter,
    pub edges: IntGauge,
    pub consumer_lag: IntGauge,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| register(registry, IntCounter::new(name, help).expect("valid metric"));
        Self {
            applied_updates: counter("tally_graph_applied_updates_total", "Graph updates applied"),
            dropped: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "tally_graph_dropped_updates_total",
                        "Graph updates dropped as duplicates or undecodable",
                    ),
                    &["reason"],
                )
                .expect("valid metric"),
            ),
            desc_changes: counter("tally_graph_desc_changes_total", "Descendant-set changes sent to counter shards"),
            outbox_relayed: counter("tally_graph_outbox_relayed_total", "Outbox messages relayed to the shard topic"),
            edges: register(registry, IntGauge::new("tally_graph_edges", "Edges in the graph").expect("valid metric")),
            consumer_lag: register(
                registry,
                IntGauge::new("tally_graph_consumer_lag_records", "Graph-update records not yet applied")
                    .expect("valid metric"),
            ),
        }
    }
}

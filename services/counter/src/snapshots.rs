//! The snapshot thread: every serving shard's store to the snapshot store when due.

use std::sync::Arc;
use std::time::Duration;

use tally_shared::config::TallyConfig;
use tally_shared::kafka::TopicNames;
use tally_shared::snapshot::{SnapshotAges, SnapshotStore, Snapshotter};

use crate::context::store_name;
use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::ShardStore;

/// How often the snapshotter looks at the shards.
pub(crate) const SNAPSHOT_CHECK: Duration = Duration::from_secs(2);

/// Snapshots the serving shards when due ([`Snapshotter`]), on a thread of its own:
/// the checkpoint is taken under the store's commit lock (moments), the upload runs
/// beside the consumer.
pub(crate) struct ShardSnapshots {
    snapshotter: Snapshotter,
    ages: SnapshotAges,
    shards: Arc<Shards>,
    metrics: Metrics,
    /// The shard topic (the snapshots' namespace).
    topic: String,
}

impl ShardSnapshots {
    pub(crate) fn new(
        snapshots: SnapshotStore,
        config: &TallyConfig,
        shards: Arc<Shards>,
        metrics: Metrics,
        registry: &prometheus::Registry,
    ) -> Self {
        let scratch = config.counter.data_dir.join(".checkpoints");
        let snapshotter = Snapshotter::new(snapshots, &config.snapshots, scratch);
        let names = ("tally_counter_snapshot_age_seconds", "tally_counter_snapshot_interval_seconds");
        let ages = SnapshotAges::new(registry, names, &["shard"], &snapshotter);
        Self { snapshotter, ages, shards, metrics, topic: TopicNames::new(&config.kafka.topic_prefix).shards() }
    }

    pub(crate) fn run(mut self) -> impl FnMut() + Send + 'static {
        move || {
            let serving: Vec<(String, Arc<ShardStore>)> = (self.shards.serving().into_iter())
                .filter_map(|shard| Some((store_name(&self.topic, shard).to_string(), self.shards.get(shard)?)))
                .collect();
            let stores: Vec<(String, &tally_shared::store::Store)> =
                serving.iter().map(|(name, store)| (name.clone(), &store.store)).collect();
            let (taken, failed) = self.snapshotter.round(&self.shards.snapshot_requests, &stores);
            self.metrics.snapshots_taken.inc_by(taken);
            self.metrics.snapshot_failures.inc_by(failed);
            let ages = serving.iter().map(|(name, store)| (vec![store.shard.to_string()], name.as_str(), &store.store));
            self.ages.report(&self.snapshotter, ages);
        }
    }
}

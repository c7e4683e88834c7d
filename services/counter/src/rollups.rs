//! Rollups: the latest value of every bucket a batch changed, published to the
//! compacted rollups topic at least once, by a thread of its own so counting never
//! waits on the rollups topic.
//!
//! A batch marks the count keys it changed in its own write batch
//! ([`ApplyReport::changed`](crate::apply::ApplyReport)); this thread reads a page of
//! marks, publishes the values the keys hold *now*, and once the broker acknowledged
//! them removes each mark whose key still holds the published value — under the
//! store's commit lock, so a key a later batch changed keeps its mark and goes again.
//! Under load a key changed by many batches is published once with its newest value
//! (the topic is compacted: only the newest value per key is kept anyway). Each
//! record carries the full value, so a repeat is harmless.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tally_core::keys::{parse_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::Resolutions;
use tally_core::wire::Rollup;
use tally_shared::config::KafkaConfig;
use tally_shared::failures::Failure;
use tally_shared::kafka::now_ms;
use tally_shared::outbox::Relay;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::ShardStore;

/// How long a round of rollups waits for its acknowledgements.
const ROLLUP_WAIT: Duration = Duration::from_secs(5);
/// Most marked rollups sent at once per shard.
const ROLLUP_PAGE: usize = 10_000;
/// How long the thread rests when nothing was marked (or a round failed).
const IDLE: Duration = Duration::from_millis(50);

pub struct Rollups {
    relay: Relay,
    resolutions: Resolutions,
}

impl Rollups {
    pub fn new(kafka: &KafkaConfig, topic: String, resolutions: Resolutions) -> Result<Self> {
        Ok(Self { relay: Relay::new(kafka, topic)?.waiting_at_most(ROLLUP_WAIT), resolutions })
    }

    /// The producer, for its health.
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// Publishes marked rollups until `shutdown`, or until the producer failed for
    /// good (the thread ends; the consume loop sees it and stops the counter).
    pub fn spawn(
        self: Arc<Self>,
        shards: Arc<Shards>,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new().name("counter-rollups".into()).spawn(move || {
            while !shutdown.is_cancelled() && self.relay.fatal().is_none() {
                if !self.round(&shards, &metrics) {
                    std::thread::sleep(IDLE);
                }
            }
        })
    }

    /// One page of every serving shard (this counter's lease holding); whether any
    /// was published and all went well (then the next round starts at once).
    fn round(&self, shards: &Shards, metrics: &Metrics) -> bool {
        let mut busy = false;
        for shard in shards.serving() {
            let Some(store) = shards.get(shard) else { continue };
            if !store.serving() || !shards.lease.valid(now_ms()) {
                continue;
            }
            match self.publish_page(&store) {
                Ok(0) => {}
                Ok(published) => {
                    metrics.rollups_published.inc_by(published as u64);
                    busy = true;
                }
                Err(err) if err.is_corruption() => {
                    let reason = format!("publishing rollups met corrupt data: {err}");
                    shards.failures.fail(shard, Failure { offset: None, reason, record: None });
                }
                Err(err) => {
                    metrics.rollups_failed.inc();
                    tracing::warn!(shard, error = %err, "publishing rollups; they go again with the next round");
                    return false;
                }
            }
        }
        busy
    }

    /// Publishes one page of a store's marked rollups; how many.
    fn publish_page(&self, store: &ShardStore) -> Result<usize> {
        let keys = store.pending_rollups(ROLLUP_PAGE)?;
        if keys.is_empty() {
            return Ok(0);
        }
        let values = store.count_values(&keys)?;
        let mut records = Vec::with_capacity(keys.len());
        for (stored_key, value) in keys.iter().zip(&values) {
            let changed = parse_count_key(stored_key)?;
            let counts = value.as_deref().map(Counts::decode).transpose()?.unwrap_or_default();
            let resolution = if changed.width_ms == ALL_TIME_WIDTH {
                "all".to_string()
            } else {
                self.resolutions
                    .by_width(changed.width_ms)
                    .map_or_else(|| format!("{}ms", changed.width_ms), |r| r.name.clone())
            };
            let key = format!("{}/{}/{}/{}", changed.entity, changed.metric, resolution, changed.bucket);
            let rollup = Rollup {
                v: tally_core::format::JSON_V1,
                entity: changed.entity.to_string(),
                metric: changed.metric.to_string(),
                resolution,
                bucket: changed.bucket,
                total: counts.total,
                direct: counts.direct,
            };
            let payload = serde_json::to_vec(&rollup).map_err(|err| Error::Consumer(err.to_string()))?;
            records.push((key, payload));
        }
        self.relay.send_keyed(records.iter().map(|(key, payload)| (key.as_str(), payload.as_slice())))?;
        let published = keys.len();
        store.rollups_published(keys.into_iter().zip(values).collect())?;
        Ok(published)
    }
}

//! Rollups: the latest value of every bucket a batch changed, published to the
//! compacted rollups topic at least once, by a thread of its own so counting never
//! waits on the rollups topic.
//!
//! A batch marks the count keys it changed in its own write batch (a key whose mark
//! is there already is not marked again: [`crate::marks`]); this thread reads a page of
//! marks, publishes the values the keys hold *now*, and once the broker acknowledged
//! them removes each mark whose key still holds the published value — under the
//! store's commit lock, so a key a later batch changed keeps its mark and goes again.
//! Under load a key changed by many batches is published once with its newest value
//! (the topic is compacted: only the newest value per key is kept anyway), and a
//! round starts at most every `counter.rollup_interval_ms` (1 s): a hot bucket goes
//! once a second, not once a batch. Each record carries the full value, so a repeat
//! is harmless.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tally_core::keys::{parse_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::Resolutions;
use tally_core::wire::Rollup;
use tally_shared::config::KafkaConfig;
use tally_shared::failures::Failure;
use tally_shared::outbox::Relay;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::ShardStore;

/// How long a round of rollups waits for its acknowledgements.
const ROLLUP_WAIT: Duration = Duration::from_secs(5);
/// Most marked rollups sent at once per shard (their marks are removed under the
/// store's commit lock, which reads wait on: pages stay small).
const ROLLUP_PAGE: usize = 1_000;
/// The shortest rest between rounds.
const IDLE: Duration = Duration::from_millis(50);

pub struct Rollups {
    relay: Relay,
    resolutions: Resolutions,
    /// A round starts at most this often (`counter.rollup_interval_ms`).
    interval: Duration,
}

impl Rollups {
    pub fn new(kafka: &KafkaConfig, topic: String, resolutions: Resolutions, interval: Duration) -> Result<Self> {
        Ok(Self { relay: Relay::new(kafka, topic)?.waiting_at_most(ROLLUP_WAIT), resolutions, interval })
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
        tally_shared::sched::background_thread("counter-rollups", move || {
            while !shutdown.is_cancelled() && self.relay.fatal().is_none() {
                let started = std::time::Instant::now();
                self.round(&shards, &metrics);
                let rest = self.interval.saturating_sub(started.elapsed()).max(IDLE);
                let until = started + rest;
                while !shutdown.is_cancelled() && std::time::Instant::now() < until {
                    std::thread::sleep(IDLE.min(until.saturating_duration_since(std::time::Instant::now())));
                }
            }
        })
    }

    /// Publishes everything marked in every serving shard (this counter's lease
    /// holding) once: a page of each shard in turn, each shard's pages resuming
    /// after the last key sent, so a busy shard neither starves the others nor sends
    /// its hot keys more than once a round. Stops at the first failure (the next
    /// round tries again).
    fn round(&self, shards: &Shards, metrics: &Metrics) {
        // Per shard: its store when the round began, and the last key sent.
        let mut cursors: Vec<(u32, Arc<ShardStore>, Option<Vec<u8>>)> =
            shards.serving().into_iter().filter_map(|shard| Some((shard, shards.get(shard)?, None))).collect();
        while !cursors.is_empty() {
            let mut more = Vec::with_capacity(cursors.len());
            for (shard, store, after) in cursors {
                // Still this counter's, the same store, serving and not failed: a
                // shard handed over mid-round publishes nothing more from here (its
                // new owner's values are newer).
                let current = shards.served(shard).filter(|now| Arc::ptr_eq(now, &store));
                if current.is_none() || shards.failures.is_failed(shard) {
                    continue;
                }
                match self.publish_page(&store, after.as_deref()) {
                    Ok((published, last)) => {
                        metrics.rollups_published.inc_by(published as u64);
                        if published == ROLLUP_PAGE {
                            more.push((shard, store, last));
                        }
                    }
                    Err(err) if err.is_corruption() => {
                        let reason = format!("publishing rollups met corrupt data: {err}");
                        shards.failures.fail(shard, Failure { offset: None, reason, record: None });
                    }
                    Err(err) => {
                        metrics.rollups_failed.inc();
                        tracing::warn!(shard, error = %err, "publishing rollups; they go again with the next round");
                        return;
                    }
                }
            }
            cursors = more;
        }
    }

    /// Publishes one page of a store's marked rollups after key `after`; how many,
    /// and the last key sent.
    fn publish_page(&self, store: &ShardStore, after: Option<&[u8]>) -> Result<(usize, Option<Vec<u8>>)> {
        let keys = store.pending_rollups_after(after, ROLLUP_PAGE)?;
        if keys.is_empty() {
            return Ok((0, None));
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
        let (published, last) = (keys.len(), keys.last().cloned());
        store.rollups_published(keys.into_iter().zip(values).collect())?;
        Ok((published, last))
    }
}

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
//! once a second, not once a batch. A round of more than one sweep (a page of each
//! shard; under a backlog a round can outlast the whole backlog) rests after each
//! sweep three times as long as the sweep took ([`REST_PER_SWEEP`]): the thread
//! publishes at most about a quarter of the time and leaves the broker to counting
//! meanwhile; what a backlog marks again goes once, with its newest value, when the
//! backlog is done. Each record carries the full value, so a repeat is harmless.
//!
//! Every record carries the shard's position its values were read at (one snapshot:
//! [`crate::store::rollup_book`]), so a consumer keeps the newest whatever the order of
//! delivery; a bucket's deadline comes due when it expires and it goes as a
//! tombstone; every live bucket goes again every [`REFRESH_EVERY_MS`].

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tally_core::keys::{parse_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::{format_duration, Resolutions};
use tally_core::wire::{Rollup, RollupPosition, ROLLUP_POSITION_HEADER};
use tally_shared::config::KafkaConfig;
use tally_shared::failures::Failure;
use tally_shared::kafka::now_ms;
use tally_shared::outbox::Relay;
use tally_shared::shutdown::sleep_unless;
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
/// How many times as long as a sweep took the thread rests after it, when pages
/// are still to go (a backlog): it publishes at most about a quarter of the time.
const REST_PER_SWEEP: u32 = 3;
/// At most this many pages of due deadlines per shard and round (a round is not
/// held open by a stream of expiries; what is left goes with the next).
const DUE_PAGES_PER_ROUND: usize = 10;
/// The shortest rest between rounds.
const IDLE: Duration = Duration::from_millis(50);
/// How often every live bucket is published again (the rollups topic deletes
/// records older than its retention, which must be longer: `topics/topics.toml`).
pub const REFRESH_EVERY_MS: i64 = 30 * 86_400_000;

/// What one page of a shard published.
#[derive(Debug, Default)]
struct Page {
    records: usize,
    tombstones: usize,
    /// A page was full: more to go.
    more: bool,
}

/// Where a shard's round stands.
#[derive(Debug, Default)]
struct Cursor {
    /// The last marked key sent (the next page starts after it).
    after: Option<Vec<u8>>,
    /// Pages of due deadlines sent.
    due_pages: usize,
}

pub struct Rollups {
    relay: Relay,
    resolutions: Resolutions,
    /// A round starts at most this often (`counter.rollup_interval_ms`).
    interval: Duration,
}

impl Rollups {
    pub fn new(kafka: &KafkaConfig, topic: String, resolutions: Resolutions, interval: Duration) -> Result<Self> {
        // Each record holds its bucket's whole value and its position: a repeat or
        // a reordering is harmless, one lost goes again from its mark; so no
        // idempotence, and a lapsed lease may purge what is queued.
        Ok(Self { relay: Relay::positioned(kafka, topic)?.waiting_at_most(ROLLUP_WAIT), resolutions, interval })
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
                let started = Instant::now();
                self.round(&shards, &metrics, |rest| sleep_unless(&shutdown, rest));
                sleep_unless(&shutdown, self.interval.saturating_sub(started.elapsed()).max(IDLE));
            }
        })
    }

    /// Publishes everything marked in every serving shard (this counter's lease
    /// holding) once: a page of each shard in turn, each shard's pages resuming
    /// after the last key sent, so a busy shard neither starves the others nor sends
    /// its hot keys more than once a round. After a sweep (a page of each shard)
    /// with pages still to go, `rest` is given [`REST_PER_SWEEP`] times as long as
    /// the sweep took (the thread's sleep; false: stop). Stops at the first failure
    /// (the next round tries again).
    fn round(&self, shards: &Shards, metrics: &Metrics, mut rest: impl FnMut(Duration) -> bool) {
        // Per shard: its store when the round began, and where its round stands.
        let mut cursors: Vec<(u32, Arc<ShardStore>, Cursor)> = shards
            .serving()
            .into_iter()
            .filter_map(|shard| Some((shard, shards.get(shard)?, Cursor::default())))
            .collect();
        // Still this counter's, the same store, serving and not failed: a shard
        // handed over mid-round publishes nothing more from here (its new owner's
        // values are newer).
        let still_ours = |shard: u32, store: &Arc<ShardStore>| {
            shards.served(shard).is_some_and(|now| Arc::ptr_eq(&now, store)) && !shards.failures.is_failed(shard)
        };
        while !cursors.is_empty() {
            let sweep = Instant::now();
            let mut more = Vec::with_capacity(cursors.len());
            for (shard, store, mut cursor) in cursors {
                if !still_ours(shard, &store) {
                    continue;
                }
                match self.publish_page(&store, &mut cursor, now_ms()) {
                    Ok(page) => {
                        metrics.rollups_published.inc_by(page.records as u64);
                        metrics.rollup_tombstones.inc_by(page.tombstones as u64);
                        if page.more {
                            more.push((shard, store, cursor));
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
            // A shard handed over meanwhile is let go before the rest, not after.
            more.retain(|(shard, store, _)| still_ours(*shard, store));
            cursors = more;
            // At most as long as a page may wait for its acknowledgement: a sweep the
            // broker slowed does not silence the rollups three times as long.
            if !cursors.is_empty() && !rest((sweep.elapsed() * REST_PER_SWEEP).min(ROLLUP_WAIT)) {
                return;
            }
        }
    }

    /// Publishes one page of a store's due deadlines (tombstones of expired
    /// buckets; up to [`DUE_PAGES_PER_ROUND`] a round) and one of its marked rollups
    /// after the cursor's key, moving the cursor on: how many records, and whether
    /// either page was full (more to go).
    fn publish_page(&self, store: &ShardStore, cursor: &mut Cursor, now: i64) -> Result<Page> {
        if let Some(marked) = store.refresh_rollups(now, REFRESH_EVERY_MS)? {
            tracing::info!(shard = store.shard, marked, "every live bucket marked to be published again (refresh)");
        }
        let mut page = Page::default();
        // A bounded share of the round for deadlines: the rest go with the next.
        let due = match cursor.due_pages < DUE_PAGES_PER_ROUND {
            true => store.due_rollups(now, ROLLUP_PAGE)?,
            false => Vec::new(),
        };
        cursor.due_pages += 1;
        page.more = due.len() == ROLLUP_PAGE && cursor.due_pages < DUE_PAGES_PER_ROUND;
        if !due.is_empty() {
            let (deadlines, keys): (Vec<Vec<u8>>, Vec<Vec<u8>>) = due.into_iter().unzip();
            self.publish(store, keys, now, &mut page)?;
            store.deadlines_done(&deadlines)?;
        }
        let keys = store.pending_rollups_after(cursor.after.as_deref(), ROLLUP_PAGE)?;
        page.more |= keys.len() == ROLLUP_PAGE;
        if let Some(last) = keys.last() {
            cursor.after = Some(last.clone());
        }
        if !keys.is_empty() {
            self.publish(store, keys, now, &mut page)?;
        }
        Ok(page)
    }

    /// Publishes the buckets of `keys` as the store holds them now, each with the
    /// shard's position — a tombstone for one expired (or no longer stored) — and
    /// records what was acknowledged (counted in `counted`).
    fn publish(&self, store: &ShardStore, keys: Vec<Vec<u8>>, now: i64, counted: &mut Page) -> Result<()> {
        let page = store.rollup_page(keys)?;
        let position = RollupPosition { shard: store.shard, offset: page.offset };
        let header = position.header_value();
        let mut records = Vec::with_capacity(page.keys.len());
        for (stored_key, value) in page.keys.iter().zip(&page.values) {
            let changed = parse_count_key(stored_key)?;
            let resolution = if changed.width_ms == ALL_TIME_WIDTH {
                "all".to_string()
            } else {
                self.resolutions
                    .by_width(changed.width_ms)
                    .map_or_else(|| format_duration(changed.width_ms as u64), |r| r.name.clone())
            };
            let mut rollup = Rollup {
                v: Rollup::V2,
                entity: changed.entity.to_string(),
                metric: changed.metric.to_string(),
                resolution,
                bucket: changed.bucket,
                total: 0,
                direct: 0,
                position: Some(position),
                expires_at: store.expires_at(&changed),
            };
            let key = rollup.key();
            let payload = match value {
                Some(value) if store.live_at(&changed, now) => {
                    let counts = Counts::decode(value)?;
                    (rollup.total, rollup.direct) = (counts.total, counts.direct);
                    Some(serde_json::to_vec(&rollup).map_err(|err| Error::Consumer(err.to_string()))?)
                }
                _ => None,
            };
            records.push((key, payload));
        }
        let sent = records.iter().map(|(key, payload)| (key.as_str(), payload.as_deref(), header.as_slice()));
        self.relay.send_with_header(ROLLUP_POSITION_HEADER, sent)?;
        counted.records += records.len();
        counted.tombstones += records.iter().filter(|(_, payload)| payload.is_none()).count();
        store.rollups_published(page, now)
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::mocking::MockCluster;

    use super::*;

    const NOW: i64 = 1_763_780_000_000;

    /// A serving shard 0 whose last batch changed `entities` entities (a rollup mark
    /// per changed bucket), and rollups to a mock cluster's topic.
    fn marked(
        entities: usize,
    ) -> (tempfile::TempDir, MockCluster<'static, rdkafka::producer::DefaultProducerContext>, Arc<Shards>, Rollups)
    {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("rollups", 1, 1).unwrap();
        let kafka = KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..entities).map(|i| format!("e{i}")).collect();
        let events: Vec<(&str, i64, i64)> = names.iter().map(|name| (name.as_str(), 1, NOW)).collect();
        let shards = crate::shards::one_shard_with(dir.path(), &events, NOW, true);
        let rollups = Rollups::new(&kafka, "rollups".into(), Resolutions::default(), Duration::from_secs(1)).unwrap();
        (dir, cluster, shards, rollups)
    }

    #[test]
    fn a_round_of_several_sweeps_rests_after_each_three_times_as_long_as_it_took() {
        let (_dir, _cluster, shards, rollups) = marked(625);
        let store = shards.get(0).unwrap();
        let marks = store.pending_rollups(usize::MAX).unwrap().len();
        // Pages of 1 000: two full sweeps and a last one.
        assert!((2 * ROLLUP_PAGE + 1..3 * ROLLUP_PAGE).contains(&marks), "{marks} marks");
        let metrics = Metrics::new(&prometheus::Registry::new());
        // Each rest asked for, with when it was asked for and when the last one ended.
        let mut rests = Vec::new();
        let mut last_rest_ended = Instant::now();
        rollups.round(&shards, &metrics, |rest| {
            rests.push((rest, last_rest_ended.elapsed()));
            last_rest_ended = Instant::now();
            true
        });
        assert_eq!(metrics.rollups_published.get(), marks as u64, "every mark published");
        assert_eq!(store.pending_rollups(usize::MAX).unwrap(), Vec::<Vec<u8>>::new());
        // A rest after each sweep that left pages to go, three times as long as that
        // sweep: the time since the last rest, less the moments between sweeps.
        assert_eq!(rests.len(), 2, "{rests:?}");
        for (rest, since_last) in &rests {
            let swept = *since_last * REST_PER_SWEEP;
            assert!(*rest <= swept && *rest >= swept / 2, "{rests:?}");
        }
    }

    #[test]
    fn a_round_stops_when_its_rest_is_cut_short() {
        let (_dir, _cluster, shards, rollups) = marked(625);
        let store = shards.get(0).unwrap();
        let marks = store.pending_rollups(usize::MAX).unwrap().len();
        let metrics = Metrics::new(&prometheus::Registry::new());
        let mut rests = 0;
        rollups.round(&shards, &metrics, |_| {
            rests += 1;
            false
        });
        assert_eq!(rests, 1);
        assert_eq!(metrics.rollups_published.get(), ROLLUP_PAGE as u64, "one sweep");
        assert_eq!(store.pending_rollups(usize::MAX).unwrap().len(), marks - ROLLUP_PAGE, "the rest waits");
    }
}

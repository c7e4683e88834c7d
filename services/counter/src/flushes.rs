//! Flushing the stores that run without RocksDB's WAL (the shard topic is their
//! journal) on a thread of their own, `counter-flushes`: with every heartbeat, the
//! owned stores that are due ([`due_for_persist`]: those flushed longest ago, about
//! every [`PERSIST_EVERY`] each). Stores that keep the WAL leave flushing to
//! RocksDB: no thread runs for them.
//!
//! A flush waits for RocksDB to write the store's memtables and holds the store's
//! commit lock meanwhile. On the consume loop's thread it would hold up the batches
//! of every shard for that long — a sixth of a counter's stores per
//! heartbeat, tens of flushes with hundreds of shards; here it holds up only the next
//! commit of the shard it flushes.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use tally_shared::store::Durability;

use crate::metrics::Metrics;
use crate::shards::Shards;

/// How long a store without the WAL goes between flushes of its own, about (Kafka
/// Streams' `commit.interval.ms` default; RocksDB also flushes a full memtable).
pub const PERSIST_EVERY: Duration = Duration::from_secs(30);

/// Which stores to flush at a heartbeat, as indexes into `last_persists` (when each
/// was last persisted or opened): those flushed longest ago that are due
/// ([`PERSIST_EVERY`] passed), at most `ceil(n × heartbeat / PERSIST_EVERY)` of
/// them — as many as flush every store once per [`PERSIST_EVERY`] at one round per
/// `heartbeat`. So stores opened together flush apart (one per heartbeat up to six
/// stores), and however many a counter owns, each flushes within
/// `PERSIST_EVERY + heartbeat` of the last time (within `2 × PERSIST_EVERY` of
/// opening, when many open together): what a crash replays stays within the
/// journal's retention ([`tally_shared::config::MIN_JOURNAL_RETENTION_MS`]).
pub fn due_for_persist(last_persists: &[Instant], now: Instant, heartbeat: Duration) -> Vec<usize> {
    let rounds_per_interval = (PERSIST_EVERY.as_millis() / heartbeat.as_millis().max(1)).max(1) as usize;
    let per_round = last_persists.len().div_ceil(rounds_per_interval);
    let mut oldest_first: Vec<usize> = (0..last_persists.len()).collect();
    oldest_first.sort_by_key(|&index| last_persists[index]);
    oldest_first.truncate(per_round);
    oldest_first.retain(|&index| now.saturating_duration_since(last_persists[index]) >= PERSIST_EVERY);
    oldest_first
}

/// Flushes the stores `shards` owns (serving, catching up or failed) that are due
/// at `now`, with one round per `heartbeat`; returns how many it flushed. One that
/// fails is logged and counted: its commits stay in memory and a crash replays them
/// from the log.
fn flush_due_stores(shards: &Shards, metrics: &Metrics, now: Instant, heartbeat: Duration) -> usize {
    let stores: Vec<_> = shards.stores().into_iter().filter_map(|shard| shards.get(shard)).collect();
    let last_persists: Vec<Instant> = stores.iter().map(|store| store.last_persist()).collect();
    let mut flushed = 0;
    for index in due_for_persist(&last_persists, now, heartbeat) {
        let store = &stores[index];
        let started = Instant::now();
        match store.persist() {
            Ok(()) => {
                metrics.store_flush_seconds.observe(started.elapsed().as_secs_f64());
                flushed += 1;
            }
            Err(err) => {
                metrics.store_flush_failures.inc();
                tracing::warn!(shard = store.shard, error = %err, "flushing the store");
            }
        }
    }
    flushed
}

/// Starts the thread that flushes the due stores every `heartbeat` until `shutdown`,
/// when they run without the WAL (`durability` is the counter's, the same for all
/// its stores); with the WAL, none.
pub fn spawn(
    shards: Arc<Shards>,
    metrics: Metrics,
    durability: Durability,
    heartbeat: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<Option<JoinHandle<()>>> {
    match durability {
        Durability::InputLog => spawn_with_clock(shards, metrics, heartbeat, shutdown, Instant::now).map(Some),
        Durability::Wal | Durability::WalSynced => Ok(None),
    }
}

fn spawn_with_clock(
    shards: Arc<Shards>,
    metrics: Metrics,
    heartbeat: Duration,
    shutdown: CancellationToken,
    clock: impl Fn() -> Instant + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    tally_shared::shutdown::every("counter-flushes", heartbeat, shutdown, move || {
        flush_due_stores(&shards, &metrics, clock(), heartbeat);
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use rocksdb::WriteBatch;
    use tally_shared::progress::Progress;

    use super::*;
    use crate::store::{ShardStore, StoreOptions};

    fn unflushed(store: &ShardStore) -> u64 {
        let entries = store.store.db().property_int_value(rocksdb::properties::NUM_ENTRIES_ACTIVE_MEM_TABLE);
        entries.unwrap().unwrap()
    }

    /// Stores without the WAL, each with a commit waiting in its memtable.
    fn owned_stores(dir: &std::path::Path, count: u32) -> Arc<Shards> {
        let options = StoreOptions { durability: Durability::InputLog, shards: count, ..StoreOptions::default() };
        let stores: HashMap<u32, Arc<ShardStore>> = (0..count)
            .map(|shard| {
                let store = ShardStore::open(shard, &dir.join(shard.to_string()), options.clone()).unwrap();
                store.commit(WriteBatch::default(), Progress { next_offset: Some(1), ..Default::default() }).unwrap();
                (shard, Arc::new(store))
            })
            .collect();
        let shards = Arc::new(Shards::default());
        shards.replace(stores, Default::default(), BTreeMap::new());
        shards
    }

    /// A round flushes the due stores it picks, at most its share of them, and
    /// nothing before they are due.
    #[test]
    fn a_round_flushes_its_share_of_the_due_stores() {
        let dir = tempfile::tempdir().unwrap();
        let shards = owned_stores(dir.path(), 12);
        let metrics = Metrics::new(&prometheus::Registry::new());
        let heartbeat = Duration::from_secs(5);
        let opened = Instant::now();
        let round = |at: Instant| flush_due_stores(&shards, &metrics, at, heartbeat);
        assert_eq!(round(opened + PERSIST_EVERY / 2), 0, "none due yet");
        let waiting =
            |shards: &Shards| shards.stores().iter().filter(|&&s| unflushed(&shards.get(s).unwrap()) > 0).count();
        assert_eq!(waiting(&shards), 12);
        // Twelve stores, six rounds per interval: two a round.
        assert_eq!(round(opened + PERSIST_EVERY + heartbeat), 2);
        assert_eq!(waiting(&shards), 10, "the two flushed wrote their memtables");
        assert_eq!(round(opened + PERSIST_EVERY + 2 * heartbeat), 2);
        assert_eq!(waiting(&shards), 8, "the next round takes two others");
        let timed = (metrics.store_flush_seconds.get_sample_count(), metrics.store_flush_failures.get());
        assert_eq!(timed, (4, 0), "(flushes timed, failures)");
    }

    /// The thread flushes every due store by itself, without the consume loop.
    #[test]
    fn the_flush_thread_flushes_due_stores_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let shards = owned_stores(dir.path(), 3);
        let shutdown = CancellationToken::new();
        // A clock two intervals ahead: every store is due at every round.
        let ahead = || Instant::now() + 2 * PERSIST_EVERY;
        let metrics = Metrics::new(&prometheus::Registry::new());
        let thread =
            spawn_with_clock(shards.clone(), metrics, Duration::from_millis(10), shutdown.clone(), ahead).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let all_flushed = || shards.stores().iter().all(|&shard| unflushed(&shards.get(shard).unwrap()) == 0);
        while !all_flushed() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        shutdown.cancel();
        thread.join().unwrap();
        let left: Vec<u64> = shards.stores().iter().map(|&shard| unflushed(&shards.get(shard).unwrap())).collect();
        assert_eq!(left, vec![0, 0, 0], "entries left in each store's memtable");
    }

    /// Stores that keep the WAL get no flush thread: RocksDB flushes them.
    #[test]
    fn stores_with_the_wal_get_no_flush_thread() {
        let dir = tempfile::tempdir().unwrap();
        let shards = owned_stores(dir.path(), 1);
        for durability in [Durability::Wal, Durability::WalSynced] {
            let metrics = Metrics::new(&prometheus::Registry::new());
            let thread =
                spawn(shards.clone(), metrics, durability, Duration::from_millis(10), CancellationToken::new());
            assert!(thread.unwrap().is_none(), "{durability:?}: a flush thread started");
        }
    }

    /// However many stores a counter owns, each is flushed within `PERSIST_EVERY +
    /// HEARTBEAT` of its last flush (`2 × PERSIST_EVERY` of opening), and the
    /// flushes of stores opened together spread over the heartbeats.
    #[test]
    fn every_store_flushes_within_the_interval_whatever_their_number() {
        let heartbeat = Duration::from_secs(5);
        // Each heartbeat a little late (the loop's own work).
        let late = heartbeat + Duration::from_millis(400);
        let opened = Instant::now();
        for stores in [1, 2, 8, 64, 256, 1000] {
            let mut last = vec![opened; stores];
            let mut flushed_before = vec![false; stores];
            let (mut first_flush, mut between_flushes) = (Duration::ZERO, Duration::ZERO);
            let (mut most_in_a_round, mut flushes) = (0, 0);
            // Ten minutes of heartbeats.
            let mut now = opened;
            for _ in 0..110 {
                now += late;
                let due = due_for_persist(&last, now, heartbeat);
                most_in_a_round = most_in_a_round.max(due.len());
                for index in due {
                    let waited = now - last[index];
                    match flushed_before[index] {
                        true => between_flushes = between_flushes.max(waited),
                        false => first_flush = first_flush.max(waited),
                    }
                    (last[index], flushed_before[index], flushes) = (now, true, flushes + 1);
                }
            }
            assert!(first_flush <= 2 * PERSIST_EVERY + late, "{stores} stores: first flushed after {first_flush:?}");
            assert!(between_flushes <= PERSIST_EVERY + late, "{stores} stores: {between_flushes:?} between flushes");
            let unflushed = last.iter().map(|at| now - *at).max().unwrap();
            assert!(unflushed <= PERSIST_EVERY + late, "{stores} stores: one unflushed for {unflushed:?} at the end");
            assert!(flushes >= stores * 15, "{stores} stores flushed {flushes} times in ten minutes");
            assert_eq!(most_in_a_round, stores.div_ceil(6), "{stores} stores: flushes spread over the rounds");
        }
    }
}

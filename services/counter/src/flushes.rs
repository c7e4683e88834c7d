//! Flushing the stores that run without RocksDB's WAL (the shard topic is their
//! journal) on a thread of their own, `counter-flushes`: with every heartbeat, the
//! owned stores that are due ([`due_for_persist`]: those flushed longest ago, about
//! every [`crate::store::PERSIST_EVERY`] each). A flush waits for RocksDB to write
//! the store's memtables and holds the store's commit lock meanwhile. On the consume
//! loop's thread, as until session 33, it held up the batches of every shard for
//! that long — a sixth of a counter's stores per heartbeat, tens of flushes with
//! hundreds of shards; here it holds up only the next commit of the shard it
//! flushes.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::due_for_persist;

/// Flushes the stores `shards` owns (serving, catching up or failed) that are due
/// at `now`, with one round per `heartbeat`; returns how many it flushed (stores
/// with the WAL never flush here: RocksDB does). One that fails is logged and
/// counted: its commits stay in memory and a crash replays them from the log.
pub fn flush_due_stores(shards: &Shards, metrics: &Metrics, now: Instant, heartbeat: Duration) -> usize {
    let stores: Vec<_> = shards.owned().into_iter().filter_map(|shard| shards.get(shard)).collect();
    let last_persists: Vec<Instant> = stores.iter().map(|store| store.last_persist()).collect();
    let mut flushed = 0;
    for index in due_for_persist(&last_persists, now, heartbeat) {
        let store = &stores[index];
        let started = Instant::now();
        match store.persist_when_due(now) {
            Ok(true) => {
                metrics.store_flush_seconds.observe(started.elapsed().as_secs_f64());
                flushed += 1;
            }
            Ok(false) => {}
            Err(err) => {
                metrics.store_flush_failures.inc();
                tracing::warn!(shard = store.shard, error = %err, "flushing the store");
            }
        }
    }
    flushed
}

/// Starts the thread that flushes the due stores every `heartbeat` until `shutdown`.
pub fn spawn(
    shards: Arc<Shards>,
    metrics: Metrics,
    heartbeat: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<JoinHandle<()>> {
    spawn_with_clock(shards, metrics, heartbeat, shutdown, Instant::now)
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
    use tally_shared::store::Durability;

    use super::*;
    use crate::store::{ShardStore, StoreOptions, PERSIST_EVERY};

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
        shards.replace(stores, BTreeMap::new());
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
            |shards: &Shards| shards.owned().iter().filter(|&&s| unflushed(&shards.get(s).unwrap()) > 0).count();
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
        let all_flushed = || shards.owned().iter().all(|&shard| unflushed(&shards.get(shard).unwrap()) == 0);
        while !all_flushed() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        shutdown.cancel();
        thread.join().unwrap();
        let left: Vec<u64> = shards.owned().iter().map(|&shard| unflushed(&shards.get(shard).unwrap())).collect();
        assert_eq!(left, vec![0, 0, 0], "entries left in each store's memtable");
    }
}

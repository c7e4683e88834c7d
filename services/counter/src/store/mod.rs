//! One counter shard's RocksDB: counts, idempotency marks and the consumer progress,
//! always written together.
//!
//! Column families: `counts` (bucket values, summed by a merge operator so the write
//! path reads only the hot keys it writes whole: [`crate::operands`]), `dedupe`
//! (idempotency marks with their first record's time, [`DedupeWindow`]), `desc` and
//! `desc_log` (the descendant view of each origin this shard owns, and the records of
//! changes not yet folded into it: [`crate::views`]),
//! `outbox` (totals for other shards, written with the state that produced them and
//! deleted once relayed), `rollups` (count keys whose latest values are still to be
//! published, marked in the same write batch as the counts), `rollup_deadlines` (when
//! each published bucket expires: [`crate::store::rollup_book`]), `segments` (the
//! segment combinations origins registered: [`crate::store::segments`]), `letters` (dead
//! letters of the first overflowing combination of each origin's metric, relayed by owners),
//! and the default one for
//! progress: the next shard-topic offset to consume, the high-water stamp of every
//! source and, while a rebuild runs, the offset it must reach. Expired buckets and
//! marks are dropped by compaction filters; reads never look at them.
//!
//! [`ShardStore`] lives here whole: opening, progress and persisting in this file,
//! the apply path in [`apply`], reads in [`read`], rollup pages and deadlines in
//! [`rollup_book`], the cap on segment combinations and segment reads in [`segments`].

pub mod apply;
pub mod read;
pub mod rollup_book;
pub mod segments;
pub mod tables;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use rocksdb::compaction_filter::Decision;
use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, MergeOperands, Options, WriteBatch};
use tally_core::keys::{decode_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::Resolutions;
use tally_shared::dedupe::DedupeWindow;
use tally_shared::lock;
use tally_shared::progress::Progress;
use tally_shared::store::{Durability, Store};

use crate::direct::DirectCache;
use crate::error::Result;
use crate::marks::MarkedKeys;
use crate::operands::OperandTally;
use crate::views::Views;

pub(crate) const CF_COUNTS: &str = "counts";
pub(crate) const CF_DEDUPE: &str = "dedupe";
/// Descendant views; read only when the store opens (see the vector memtable in
/// [`ShardStore::open`]).
pub(crate) const CF_DESC: &str = "desc";
/// Records of descendant changes not yet folded into `desc` ([`crate::views`]);
/// read only when the store opens, like `desc`.
pub(crate) const CF_DESC_LOG: &str = "desc_log";
pub(crate) const CF_OUTBOX: &str = "outbox";
pub(crate) const CF_ROLLUPS: &str = "rollups";
/// When each published bucket expires, for its tombstone ([`crate::store::rollup_book`]).
pub(crate) const CF_ROLLUP_DEADLINES: &str = "rollup_deadlines";
/// The shard-topic offset a store built from scratch must reach before it serves.
const KEY_REBUILD_UNTIL: &[u8] = b"rebuild_until";
/// What [`ShardStore::catching_up`]'s lock guards.
const CATCHING_UP: &str = "a shard store's catch-up time";

/// Where a store is in catching up with its log.
#[derive(Debug, Clone, Copy)]
enum CatchingUp {
    No,
    Since(Instant),
    /// Caught up, in this long: not reported yet.
    Took(std::time::Duration),
}
/// Settings of a shard store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub resolutions: Resolutions,
    pub dedupe_window_ms: i64,
    /// How commits survive a crash (by default the shard topic is the journal).
    pub durability: Durability,
    /// How many shards there are (where a descendant's totals live).
    pub shards: u32,
    /// The most bytes of one outbox record ([`tally_core::records`]).
    pub record_budget: usize,
    /// About how many bytes of origins' direct counts are kept in memory
    /// ([`crate::direct`]); 0: none.
    pub direct_cache_bytes: usize,
    /// Bytes of records of descendant changes logged before they are folded into
    /// the views ([`crate::views`]): what a store replays when it opens.
    pub view_log_bytes: usize,
    /// Segment combinations one origin's metric registers before new ones
    /// overflow (`counting.max_segment_combinations`, [`crate::store::segments`]).
    pub max_segment_combinations: u32,
    /// The producers' increments topic, which the dead letters of overflowing
    /// combinations name.
    pub increments_topic: String,
    /// The block cache the store reads its tables through, shared by every store
    /// opened with a clone of these options ([`tables`]).
    pub block_cache: tables::BlockCache,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            resolutions: Resolutions::default(),
            dedupe_window_ms: 86_400_000,
            durability: Durability::InputLog,
            shards: 1,
            record_budget: tally_shared::config::KafkaConfig::default().record_budget(),
            direct_cache_bytes: tally_shared::config::CounterConfig::default().direct_cache_bytes,
            view_log_bytes: 4 << 20,
            max_segment_combinations: tally_core::segments::DEFAULT_MAX_COMBINATIONS,
            increments_topic: tally_shared::kafka::TopicNames::new("tally.").increments(),
            block_cache: tables::BlockCache::new(tally_shared::config::CounterConfig::default().block_cache_bytes)
                .expect("RocksDB allocates an LRU cache's handle"),
        }
    }
}

/// What the lock of a store's last persist guards, for [`lock::poisoned`].
const LAST_PERSIST: &str = "a shard's last persist time";

/// A shard's database and what the counter keeps of it in memory.
///
/// Its methods live by concern: opening, progress and persisting here; the apply
/// path in [`crate::store::apply`] (one batch at a time, on the consume loop or a helper
/// apply thread: [`crate::consumer`]); reads in [`crate::store::read`] (the HTTP and read
/// link threads); rollups in [`crate::store::rollup_book`] (the rollups thread).
///
/// **Lock order.** A thread that holds several of its locks took them in this
/// order, and takes none of them while it holds [`crate::shards::Shards`]'
/// ownership lock for writing: `descendants` ([`ShardStore::views`]), `segments`
/// ([`segments::Admissions`]), `marked` ([`ShardStore::marked`]), `direct`
/// ([`ShardStore::direct_cache`]), `operands` ([`ShardStore::operand_tally`]);
/// `last_persist` alone. The apply path takes
/// them all, in that order, for a batch; readers take `descendants` alone and
/// the rollups thread `marked` alone. All are taken through
/// [`tally_shared::lock`]: a poisoned one stops the process.
pub struct ShardStore {
    pub shard: u32,
    /// The database and its progress ([`tally_shared::store`]).
    pub(crate) store: Store,
    pub(crate) options: StoreOptions,
    /// desc(origin) of every origin with descendants, sorted; mirrors the `desc`
    /// column family and its log ([`crate::views`]). Only the thread applying
    /// this shard's batch changes it (one at a time: [`crate::consumer`]).
    pub(crate) descendants: Mutex<Views>,
    /// Idempotency marks live for this window of record time.
    dedupe: DedupeWindow,
    /// Count keys whose rollup marks are committed ([`crate::marks`]).
    marked: Mutex<MarkedKeys>,
    /// Direct counts of origins read lately ([`crate::direct`]); only the thread
    /// applying this shard's batch touches it.
    pub(crate) direct: Mutex<DirectCache>,
    /// Merge operands stacked per count key ([`crate::operands`]); only the thread
    /// applying this shard's batch touches it.
    pub(crate) operands: Mutex<OperandTally>,
    /// How many segment combinations origins registered ([`crate::store::segments`]);
    /// only the thread applying this shard's batch touches it.
    pub(crate) segments: Mutex<segments::Registered>,
    /// A store built from scratch must reach this shard-topic offset (the log's end
    /// when it was assigned) before it serves: until then its totals are partial.
    /// `i64::MIN`: serving.
    rebuild_until: AtomicI64,
    /// When this process began waiting for `rebuild_until`, then, once reached, how
    /// long that took (until [`ShardStore::take_caught_up`] reports it).
    catching_up: Mutex<CatchingUp>,
    /// When the store was last persisted (or opened).
    last_persist: Mutex<Instant>,
    /// Every rollup deadline before this time is done ([`crate::store::rollup_book`]).
    pub(crate) deadlines_done_until: AtomicI64,
    /// What it applied, and how fresh that is ([`crate::freshness`]).
    pub freshness: crate::freshness::Freshness,
}

/// Sums counts. A malformed value or operand fails the merge (`None`): RocksDB then
/// reports corruption to the read that needed it (or to a flush or compaction), and
/// the shard stops. A batch that is to write a key's sum ([`crate::operands`]) reads
/// the stored value first, and fails the same way.
fn add_counts(key: &[u8], existing: Option<&[u8]>, operands: &MergeOperands) -> Option<Vec<u8>> {
    let decode = |bytes: &[u8]| match Counts::decode(bytes) {
        Ok(counts) => Some(counts),
        Err(err) => {
            tracing::error!(key = %String::from_utf8_lossy(key), error = %err, "corrupt counts: the merge fails");
            None
        }
    };
    let mut sum = match existing {
        Some(bytes) => decode(bytes)?,
        None => Counts::default(),
    };
    for operand in operands {
        sum = sum + decode(operand)?;
    }
    Some(sum.encode().to_vec())
}

fn wall_clock_ms() -> i64 {
    tally_shared::kafka::now_ms()
}

/// RocksDB's background jobs of a store: one flush and one compaction at a time.
const BACKGROUND_JOBS: i32 = 2;

impl ShardStore {
    /// Starts RocksDB's flush and compaction threads, which every store of the
    /// process shares, on the calling thread: RocksDB starts them on the thread that
    /// opens the first store, and they keep that thread's priority for good (the
    /// apply loop, which opens stores as shards come, runs nicer).
    pub fn start_background_threads() -> Result<()> {
        let mut env = rocksdb::Env::new()?;
        // How RocksDB splits `max_background_jobs`: a quarter flushes (at least
        // one), the rest compactions.
        let flushes = (BACKGROUND_JOBS / 4).max(1);
        env.set_high_priority_background_threads(flushes);
        env.set_background_threads((BACKGROUND_JOBS - flushes).max(1));
        Ok(())
    }

    /// Opens (creating when missing) the store of `shard` at `path`.
    pub fn open(shard: u32, path: &Path, options: StoreOptions) -> Result<Self> {
        let mut db_options = Options::default();
        db_options.set_max_background_jobs(BACKGROUND_JOBS);

        let tables = |mut family: Options| {
            options.block_cache.apply_to(&mut family);
            family
        };
        let mut counts = Options::default();
        counts.set_write_buffer_size(16 << 20);
        counts.set_merge_operator_associative("tally_add_counts", add_counts);
        let retention: HashMap<i64, i64> = options.resolutions.iter().map(|r| (r.width_ms, r.retention_ms)).collect();
        counts.set_compaction_filter("tally_bucket_ttl", move |_level: u32, key: &[u8], _value: &[u8]| {
            match decode_count_key(key) {
                Some(k) if k.width_ms != ALL_TIME_WIDTH => match retention.get(&k.width_ms) {
                    Some(&keep) if k.bucket.saturating_add(k.width_ms).saturating_add(keep) <= wall_clock_ms() => {
                        Decision::Remove
                    }
                    _ => Decision::Keep,
                },
                _ => Decision::Keep,
            }
        });

        let mut dedupe = Options::default();
        dedupe.set_write_buffer_size(4 << 20);
        let dedupe_window = match options.durability {
            Durability::InputLog => DedupeWindow::until_flushed(options.dedupe_window_ms),
            Durability::Wal | Durability::WalSynced => DedupeWindow::new(options.dedupe_window_ms),
        };
        dedupe.set_compaction_filter("tally_dedupe_ttl", dedupe_window.compaction_filter());

        // The descendant views and their log are read only when the store opens
        // (into `descendants`); a fold of the log rewrites the view of every origin
        // changed since the last one in one commit. A vector memtable appends each,
        // where the skiplist searched for its place (sorted when flushed). Keep it
        // write-only: a read of a mutable vector memtable copies and sorts the whole
        // memtable. It takes no concurrent inserts, so RocksDB inserts a write
        // group's batches one after another (writes from other threads — outbox and
        // rollup deletes, metadata — are serialised by RocksDB, just not inserted
        // in parallel).
        let mut desc = Options::default();
        desc.set_memtable_factory(rocksdb::MemtableFactory::Vector);
        db_options.set_allow_concurrent_memtable_write(false);

        let families = vec![
            // Named, or RocksDB opens it with default options (a cache of its own).
            ColumnFamilyDescriptor::new(rocksdb::DEFAULT_COLUMN_FAMILY_NAME, tables(Options::default())),
            ColumnFamilyDescriptor::new(CF_COUNTS, tables(counts)),
            ColumnFamilyDescriptor::new(CF_DEDUPE, tables(dedupe)),
            ColumnFamilyDescriptor::new(CF_DESC, tables(desc.clone())),
            ColumnFamilyDescriptor::new(CF_DESC_LOG, tables(desc)),
            ColumnFamilyDescriptor::new(CF_OUTBOX, tables(Options::default())),
            ColumnFamilyDescriptor::new(CF_ROLLUPS, tables(Options::default())),
            ColumnFamilyDescriptor::new(CF_ROLLUP_DEADLINES, tables(Options::default())),
            // Created empty when a store written before segments opens.
            ColumnFamilyDescriptor::new(segments::CF_SEGMENTS, tables(Options::default())),
            ColumnFamilyDescriptor::new(segments::CF_LETTERS, tables(Options::default())),
        ];
        let store = Store::open(path, db_options, families, options.durability)?;
        let descendants = Views::load(&store)?;
        let rebuild_until = match store.db().get(KEY_REBUILD_UNTIL)? {
            Some(bytes) => tally_core::format::decode_i64_value(&bytes, "rebuild_until")?,
            None => i64::MIN,
        };
        let direct = Mutex::new(DirectCache::new(options.direct_cache_bytes));
        let freshness = crate::freshness::Freshness::new(store.next_offset().unwrap_or(0));
        Ok(Self {
            shard,
            store,
            options,
            descendants: Mutex::new(descendants),
            dedupe: dedupe_window,
            marked: Mutex::new(MarkedKeys::new(crate::marks::MAX_MARKED)),
            direct,
            operands: Mutex::default(),
            segments: Mutex::default(),
            rebuild_until: AtomicI64::new(rebuild_until),
            catching_up: Mutex::new(match rebuild_until {
                i64::MIN => CatchingUp::No,
                _ => CatchingUp::Since(Instant::now()),
            }),
            last_persist: Mutex::new(Instant::now()),
            deadlines_done_until: AtomicI64::new(i64::MIN),
            freshness,
        })
    }

    /// desc(origin) as this shard currently sees it.
    pub fn descendants_of(&self, origin: &str) -> Vec<String> {
        self.views().map.get(origin).cloned().unwrap_or_default()
    }

    /// The descendant views (first in the lock order: [`ShardStore`]).
    pub(crate) fn views(&self) -> MutexGuard<'_, Views> {
        lock::lock(&self.descendants, "a shard's descendant views")
    }

    /// The direct counts cached (fourth in the lock order).
    pub(crate) fn direct_cache(&self) -> MutexGuard<'_, DirectCache> {
        lock::lock(&self.direct, "a shard's direct-count cache")
    }

    /// The merge-operand tally (fifth in the lock order).
    pub(crate) fn operand_tally(&self) -> MutexGuard<'_, OperandTally> {
        lock::lock(&self.operands, "a shard's operand tally")
    }

    /// The outbox in send order (by source offset, then target shard); relayed
    /// by [`ShardStore::relay_outbox`] alone.
    #[cfg(test)]
    pub fn outbox(&self) -> Result<Vec<tally_shared::outbox::OutboxEntry>> {
        Ok(self.store.outbox(CF_OUTBOX)?)
    }

    /// The dead letters not yet relayed ([`crate::store::segments`]), in order.
    pub fn letters(&self) -> Result<Vec<tally_shared::outbox::OutboxEntry>> {
        Ok(self.store.outbox(segments::CF_LETTERS)?)
    }

    /// Drops relayed dead letters.
    pub fn delete_letters(&self, entries: &[tally_shared::outbox::OutboxEntry]) -> Result<()> {
        Ok(self.store.delete_outbox(segments::CF_LETTERS, entries)?)
    }

    /// Drops relayed outbox entries.
    #[cfg(test)]
    pub fn delete_outbox(&self, entries: &[tally_shared::outbox::OutboxEntry]) -> Result<()> {
        Ok(self.store.delete_outbox(CF_OUTBOX, entries)?)
    }

    /// Relays the outbox ([`Store::relay_outbox`]); returns how many entries went.
    pub fn relay_outbox(&self, relay: &tally_shared::outbox::Relay) -> Result<u64> {
        Ok(self.store.relay_outbox(CF_OUTBOX, relay, &self.shard.to_string())?)
    }

    /// How far it applied, relayed and took each of `sources` ([`Store::positions`]).
    pub fn positions(&self, sources: &[tally_core::wire::Source]) -> Result<tally_core::wire::Positions> {
        Ok(self.store.positions(CF_OUTBOX, sources)?)
    }

    /// The count keys known to be marked for rollups (third in the lock order); held
    /// by a batch from its first look-up until it committed.
    pub(crate) fn marked(&self) -> MutexGuard<'_, MarkedKeys> {
        lock::lock(&self.marked, "a shard's rollup marks")
    }

    pub(crate) fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        Ok(self.store.cf(name)?)
    }

    /// The column family of counts (the benchmarks' per-event baseline writes there).
    pub fn counts_family(&self) -> Result<&ColumnFamily> {
        self.cf(CF_COUNTS)
    }

    /// What the shard was opened with.
    pub fn store_options(&self) -> &StoreOptions {
        &self.options
    }

    /// The shard's RocksDB store, to snapshot it.
    pub fn rocks(&self) -> &Store {
        &self.store
    }

    /// A copy of the committed progress.
    pub fn progress(&self) -> Progress {
        self.store.progress()
    }

    /// The committed next shard-topic offset.
    pub fn next_offset(&self) -> Option<i64> {
        self.store.next_offset()
    }

    /// Every commit so far on disk ([`Store::persist`]): a stopping counter's, so
    /// the next start replays nothing.
    pub fn persist(&self) -> Result<()> {
        let times = self.dedupe.stream_times();
        self.store.persist()?;
        self.dedupe.flushed(times);
        *lock::lock(&self.last_persist, LAST_PERSIST) = Instant::now();
        Ok(())
    }

    /// When the store was last persisted (or opened).
    pub fn last_persist(&self) -> Instant {
        *lock::lock(&self.last_persist, LAST_PERSIST)
    }

    /// Whether `(entity, id)` was seen within the dedupe window of a record at
    /// `record_time` (both times are the records' own, not the apply time).
    pub(crate) fn seen_recently(&self, key: &[u8], record_time: i64) -> Result<bool> {
        let cf = self.cf(CF_DEDUPE)?;
        Ok(match self.store.db().get_pinned_cf(cf, key)? {
            Some(mark) => self.dedupe.repeats(&mark, record_time)?,
            None => false,
        })
    }

    /// Whether a record at `record_time` repeats an id first seen at `mark_time` in
    /// the batch being written (the mark not stored yet): the window's rule.
    pub(crate) fn repeats_in_batch(&self, mark_time: i64, record_time: i64) -> bool {
        self.dedupe.within(mark_time, record_time)
    }

    /// Holds back serving until the store reached `end`: called when it was built
    /// from scratch or restored from a snapshot, a rebuild from the log. Persisted, so a counter
    /// restarted mid-rebuild still waits.
    pub fn rebuild_until(&self, end: i64) -> Result<()> {
        if self.next_offset().is_none_or(|next| next < end) && end > 0 {
            self.store.put_meta(KEY_REBUILD_UNTIL, &tally_core::format::i64_value(end))?;
            self.rebuild_until.store(end, Ordering::Relaxed);
            let mut catching_up = lock::lock(&self.catching_up, CATCHING_UP);
            if !matches!(*catching_up, CatchingUp::Since(_)) {
                *catching_up = CatchingUp::Since(Instant::now());
            }
        }
        Ok(())
    }

    /// How long the store took to catch up with its log, once, after it did.
    pub fn take_caught_up(&self) -> Option<std::time::Duration> {
        let mut catching_up = lock::lock(&self.catching_up, CATCHING_UP);
        match *catching_up {
            CatchingUp::Took(took) => {
                *catching_up = CatchingUp::No;
                Some(took)
            }
            _ => None,
        }
    }

    /// Whether the store holds everything the log held when it was assigned (or
    /// had data of its own then), so its answers and rollups are whole.
    pub fn serving(&self) -> bool {
        let until = self.rebuild_until.load(Ordering::Relaxed);
        if until == i64::MIN {
            return true;
        }
        if self.next_offset().is_some_and(|next| next >= until) {
            // Caught up, and offsets only move forward: later calls need not take the
            // commit lock (every read asks). A wait set since then stays (the exchange
            // then fails, as it should).
            if self.rebuild_until.compare_exchange(until, i64::MIN, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                let mut catching_up = lock::lock(&self.catching_up, CATCHING_UP);
                if let CatchingUp::Since(since) = *catching_up {
                    *catching_up = CatchingUp::Took(since.elapsed());
                }
            }
            return true;
        }
        false
    }

    /// `source`'s stream time in the dedupe window moves to `record_time` (a
    /// committed record's).
    pub(crate) fn advance_stream_time(&self, source: tally_core::wire::Source, record_time: i64) {
        self.dedupe.advance(source, record_time);
    }

    /// Writes `batch` plus the new progress atomically.
    pub fn commit(&self, batch: WriteBatch, progress: Progress) -> Result<()> {
        Ok(self.store.commit(batch, progress)?)
    }

    /// The counts stored under each key (zero when absent; an error when malformed).
    pub fn get_counts<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Counts>> {
        let cf = self.cf(CF_COUNTS)?;
        self.store
            .db()
            .batched_multi_get_cf(cf, keys.iter().map(AsRef::as_ref), false)
            .into_iter()
            .map(|r| Ok(r?.map(|v| Counts::decode(&v)).transpose()?.unwrap_or_default()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tally_core::wire::{Source, Stamp};

    use super::*;

    pub(crate) fn options() -> StoreOptions {
        StoreOptions::default()
    }

    #[test]
    fn a_store_built_from_scratch_serves_once_it_caught_up_with_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        store.rebuild_until(3).unwrap();
        assert!(!store.serving(), "empty, the log holds 3 records");
        store.commit(WriteBatch::default(), Progress { next_offset: Some(2), ..Default::default() }).unwrap();
        assert!(!store.serving(), "2 of 3 applied");
        drop(store);
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        assert!(!store.serving(), "restarted mid-rebuild: still 2 of 3");
        assert_eq!(store.take_caught_up(), None, "not caught up");
        std::thread::sleep(std::time::Duration::from_millis(20));
        store.commit(WriteBatch::default(), Progress { next_offset: Some(3), ..Default::default() }).unwrap();
        assert!(store.serving());
        assert!(store.serving(), "still, once the wait is lifted");
        // How long it took since this process began waiting, reported once.
        let took = store.take_caught_up().expect("caught up");
        assert!(took >= std::time::Duration::from_millis(20), "{took:?}");
        assert_eq!(store.take_caught_up(), None);
        store.rebuild_until(5).unwrap();
        assert!(!store.serving(), "a later rebuild waits again");
        store.commit(WriteBatch::default(), Progress { next_offset: Some(5), ..Default::default() }).unwrap();
        assert!(store.serving());
        assert!(store.take_caught_up().is_some(), "each rebuild's time");
        // A restored store (data of its own, older than the log) waits too.
        drop(store);
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        store.rebuild_until(10).unwrap();
        assert!(!store.serving(), "3 of 10");
        store.rebuild_until(2).unwrap();
        assert!(!store.serving(), "an older end does not lift the wait");
    }

    #[test]
    fn progress_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let source = Source { stream: Source::INCREMENTS, partition: 3 };
        {
            let store = ShardStore::open(0, dir.path(), options()).unwrap();
            assert_eq!(store.progress(), Progress::default());
            let mut progress = Progress { next_offset: Some(42), ..Default::default() };
            progress.high_water.insert(source, Stamp { offset: 7, index: 2 });
            store.commit(WriteBatch::default(), progress).unwrap();
        }
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let progress = store.progress();
        assert_eq!(progress.next_offset, Some(42));
        assert_eq!(progress.high_water[&source], Stamp { offset: 7, index: 2 });
    }
}

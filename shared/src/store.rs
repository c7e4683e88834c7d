//! The RocksDB skeleton of every stateful log processor (a counter shard, the
//! graph): opened with its column families, its format checked, its progress loaded;
//! state is written only by [`Store::commit`], which puts the progress of the batch
//! (next input offset, high-water stamps) in the same write batch — a batch cannot
//! commit without its progress, so the store is never ahead of or behind its input.
//! Its outbox (messages written with the state that produced them) is read and
//! pruned here too. How commits survive a crash is the store's [`Durability`].

use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, MutexGuard};

use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, Options, WriteBatch, WriteOptions, DB};

use crate::outbox::{delete_outbox, read_outbox, OutboxEntry, Relay};
use crate::progress::{check_store_format, Progress};
use crate::{Error, Result};

/// How a store's commits survive a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// RocksDB's write-ahead log, left to the OS: a killed process loses no commit.
    Wal,
    /// The write-ahead log fsynced at each commit: power loss loses none either.
    WalSynced,
    /// No write-ahead log: the processor's input log is the journal, as a Kafka
    /// Streams changelog is for its RocksDB stores. Commits live in memtables until
    /// RocksDB flushes them, every column family at once (`atomic_flush`), so a
    /// crash leaves the state of some earlier commit whole, its progress with it,
    /// and the processor replays the records after it — what a redelivery is
    /// already. Only for a store whose input is kept at least until its next flush
    /// (a snapshot's checkpoint flushes; so does [`Store::persist`]).
    InputLog,
}

/// A processor's database and its committed progress.
pub struct Store {
    db: DB,
    /// Mirrors the progress keys of the last committed write batch; one thread at
    /// a time commits (the one applying this store's batch).
    progress: Mutex<Progress>,
    durability: Durability,
    /// Everything the outbox held because of records before this offset is
    /// acknowledged ([`Store::relay_outbox`]).
    relayed: AtomicI64,
}

/// The key, in the default column family, of the id of the topic the store applied.
const KEY_TOPIC_ID: &[u8] = b"topic_id";

fn rocks(err: rocksdb::Error) -> Error {
    Error::Rocks(err)
}

impl Store {
    /// Opens (creating when missing) the store at `path` with `families` next to the
    /// default one, checks its format version and loads its progress.
    pub fn open(
        path: &Path,
        mut options: Options,
        families: Vec<ColumnFamilyDescriptor>,
        durability: Durability,
    ) -> Result<Self> {
        std::fs::create_dir_all(path)?;
        options.create_if_missing(true);
        options.create_missing_column_families(true);
        // Without the WAL a column family flushed alone would outlive a crash ahead
        // of (or behind) the progress in another one.
        options.set_atomic_flush(durability == Durability::InputLog);
        let db = DB::open_cf_descriptors(&options, path, families).map_err(rocks)?;
        check_store_format(&db)?;
        let progress = Progress::load(&db)?;
        Ok(Self { db, progress: Mutex::new(progress), durability, relayed: AtomicI64::new(0) })
    }

    /// For reads — gets, iterators, snapshots. State is written only by
    /// [`Store::commit`]; acknowledged bookkeeping by [`Store::delete`].
    pub fn db(&self) -> &DB {
        &self.db
    }

    pub fn cf(&self, name: &str) -> Result<&ColumnFamily> {
        self.db.cf_handle(name).ok_or_else(|| Error::Store(format!("column family {name} missing")))
    }

    fn committed(&self) -> MutexGuard<'_, Progress> {
        crate::lock::lock(&self.progress, "a store's committed progress")
    }

    /// A copy of the committed progress.
    pub fn progress(&self) -> Progress {
        self.committed().clone()
    }

    /// The committed next input offset alone (no copy of the high-water marks):
    /// for the checks made every turn of the loop.
    pub fn next_offset(&self) -> Option<i64> {
        self.committed().next_offset
    }

    /// Writes `batch` and `progress` atomically, then publishes the progress.
    pub fn commit(&self, mut batch: WriteBatch, progress: Progress) -> Result<()> {
        let mut committed = self.committed();
        progress.write(&committed, &mut batch);
        let mut write_options = WriteOptions::default();
        write_options.set_sync(self.durability == Durability::WalSynced);
        write_options.disable_wal(self.durability == Durability::InputLog);
        self.db.write_opt(batch, &write_options).map_err(rocks)?;
        *committed = progress;
        Ok(())
    }

    /// Makes every commit so far survive a crash: under [`Durability::InputLog`]
    /// flushes every column family's memtable at once (a manual compaction of the
    /// default family, whose memtable the progress keys keep non-empty, flushes them
    /// all first with `atomic_flush`: RocksDB's C API has no flush of several column
    /// families; the family itself holds a few progress keys). For what cannot be
    /// replayed from the input (an operator's skip), at a processor's stop, and
    /// periodically, so that a crash replays little.
    pub fn persist(&self) -> Result<()> {
        if self.durability == Durability::InputLog {
            let _committed = self.committed();
            // Not exclusive: it need not wait for RocksDB's own compactions.
            let mut compact = rocksdb::CompactOptions::default();
            compact.set_exclusive_manual_compaction(false);
            self.db.compact_range_opt::<&[u8], &[u8]>(None, None, &compact);
            // The C API swallows the compaction's status: that the memtable holding
            // the progress keys is empty says the flush happened (nothing else writes
            // it while the commit lock is held).
            let left = self.db.property_int_value(rocksdb::properties::NUM_ENTRIES_ACTIVE_MEM_TABLE).map_err(rocks)?;
            if left != Some(0) {
                return Err(Error::Store(format!("a flush of the store left {left:?} entries in its memtable")));
            }
        }
        Ok(())
    }

    /// Moves the offset past the record at `offset`, which an operator skipped
    /// (`tally shards skip`): nothing at or past it may have been applied. Already
    /// past it (a skip carried out again) is fine.
    pub fn skip_record(&self, offset: i64) -> Result<()> {
        let mut progress = self.progress();
        if progress.next_offset == Some(offset + 1) {
            return Ok(());
        }
        if progress.next_offset.is_some_and(|next| next > offset) {
            let next = progress.next_offset;
            return Err(Error::Skip(format!("offset {offset} was already applied (next is {next:?})")));
        }
        progress.next_offset = Some(offset + 1);
        self.commit(WriteBatch::default(), progress)?;
        self.persist()
    }

    /// A RocksDB checkpoint of the store in `dir` (which must not exist), taken
    /// under the commit lock: exactly the state of the returned progress.
    pub fn checkpoint(&self, dir: &Path) -> Result<Progress> {
        let committed = self.committed();
        rocksdb::checkpoint::Checkpoint::new(&self.db).and_then(|c| c.create_checkpoint(dir)).map_err(rocks)?;
        Ok(committed.clone())
    }

    /// The id of the topic this store applied ([`crate::topic_id`]), if recorded.
    pub fn topic_id(&self) -> Result<Option<String>> {
        let Some(bytes) = self.db.get(KEY_TOPIC_ID).map_err(rocks)? else { return Ok(None) };
        let body = tally_core::format::value_body(&bytes, "topic id")?;
        let id = std::str::from_utf8(body).map_err(|_| Error::Store("topic id: not UTF-8".into()))?;
        Ok(Some(id.to_string()))
    }

    /// Records the id of the topic this store applies (persisted at once).
    pub fn record_topic_id(&self, id: &str) -> Result<()> {
        self.put_meta(KEY_TOPIC_ID, &tally_core::format::value(id.as_bytes()))
    }

    /// A value outside the state (such as the offset a rebuild must reach).
    pub fn put_meta(&self, key: &[u8], value: &[u8]) -> Result<()> {
        // Under the commit lock, as every write of the default family's memtable
        // ([`Store::persist`] checks it empty).
        let _committed = self.committed();
        self.db.put(key, value).map_err(rocks)
    }

    /// Deletes `keys` of column family `cf`: bookkeeping of what was acknowledged
    /// (published rollup marks), never state.
    pub fn delete<K: AsRef<[u8]>>(&self, cf: &str, keys: &[K]) -> Result<()> {
        let cf = self.cf(cf)?;
        let mut batch = WriteBatch::default();
        for key in keys {
            batch.delete_cf(cf, key);
        }
        self.bookkeeping(batch)
    }

    /// Writes `batch` of bookkeeping (what was published and is still to be:
    /// rollup marks and deadlines), never state, and never the default family.
    pub fn bookkeeping(&self, batch: WriteBatch) -> Result<()> {
        self.db.write(batch).map_err(rocks)
    }

    /// A snapshot of the store with its next input offset: every record before it
    /// applied in what the snapshot reads, none after (taken under the commit lock).
    pub fn snapshot(&self) -> (rocksdb::Snapshot<'_>, Option<i64>) {
        let committed = self.committed();
        (self.db.snapshot(), committed.next_offset)
    }

    /// Deletes the marks (column family `marks`) of the keys whose value in column
    /// family `state` is still the one given — what was published from it — under
    /// the commit lock, so no batch commits in between: a key a later batch changed
    /// keeps its mark. Bookkeeping of what was acknowledged, never state. Returns
    /// the positions in `published` whose marks were deleted.
    pub fn unmark_unchanged(
        &self,
        marks: &str,
        state: &str,
        published: &[(Vec<u8>, Option<Vec<u8>>)],
    ) -> Result<Vec<usize>> {
        let _no_commits = self.committed();
        let (marks_cf, state_cf) = (self.cf(marks)?, self.cf(state)?);
        let now = self.db.batched_multi_get_cf(state_cf, published.iter().map(|(key, _)| key.as_slice()), false);
        let mut batch = WriteBatch::default();
        let mut unmarked = Vec::new();
        for (at, ((key, value), now)) in published.iter().zip(now).enumerate() {
            if now.map_err(rocks)?.as_deref() == value.as_deref() {
                batch.delete_cf(marks_cf, key);
                unmarked.push(at);
            }
        }
        self.db.write(batch).map_err(rocks)?;
        Ok(unmarked)
    }

    /// The outbox held in column family `cf`, in send order.
    pub fn outbox(&self, cf: &str) -> Result<Vec<OutboxEntry>> {
        read_outbox(&self.db, self.cf(cf)?)
    }

    /// Drops relayed entries from the outbox in `cf`.
    pub fn delete_outbox(&self, cf: &str, entries: &[OutboxEntry]) -> Result<()> {
        delete_outbox(&self.db, self.cf(cf)?, entries)
    }

    /// Sends the outbox in `cf` through `relay` (keyed `key`), waits for the
    /// broker's acknowledgements and drops what it sent; returns how many. What
    /// fails stays for the next round.
    pub fn relay_outbox(&self, cf: &str, relay: &Relay, key: &str) -> Result<u64> {
        // Read before the outbox: the outbox then holds everything of the records
        // before it (a commit writes entries and progress together).
        let applied = self.next_offset().unwrap_or(0);
        let entries = self.outbox(cf)?;
        if !entries.is_empty() {
            relay.send_all(key, &entries)?;
            self.delete_outbox(cf, &entries)?;
        }
        self.relayed.fetch_max(applied, Ordering::Relaxed);
        Ok(entries.len() as u64)
    }

    /// How far it applied, relayed what that sent on (its outbox in `cf`), and took
    /// each of `sources`, from one committed state.
    pub fn positions(&self, cf: &str, sources: &[tally_core::wire::Source]) -> Result<tally_core::wire::Positions> {
        let progress = self.progress();
        let applied = progress.next_offset.unwrap_or(0);
        // Read after the progress: an outbox found empty holds nothing of what it
        // says was applied, so all of that is relayed.
        let empty = match self.db.iterator_cf(self.cf(cf)?, rocksdb::IteratorMode::Start).next() {
            None => true,
            Some(item) => item.map(|_| false).map_err(rocks)?,
        };
        let relayed = if empty { applied } else { self.relayed.load(Ordering::Relaxed).min(applied) };
        let high_water = sources.iter().map(|source| progress.high_water.get(source).copied()).collect();
        Ok(tally_core::wire::Positions { applied, relayed, high_water })
    }
}

#[cfg(test)]
mod tests {
    use tally_core::wire::{Source, Stamp};

    use super::*;

    /// A store whose files were damaged says so as corruption (the shard stops),
    /// not as a passing error.
    #[test]
    fn damaged_files_are_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let families = || vec![ColumnFamilyDescriptor::new("state", Options::default())];
        {
            let store = Store::open(dir.path(), Options::default(), families(), Durability::InputLog).unwrap();
            let mut batch = WriteBatch::default();
            for i in 0..1_000u32 {
                batch.put_cf(store.cf("state").unwrap(), i.to_be_bytes(), [7u8; 100]);
            }
            store.commit(batch, Progress { next_offset: Some(1), ..Default::default() }).unwrap();
            store.persist().unwrap();
        }
        // Every table file's middle overwritten.
        let mut damaged = 0;
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sst") {
                let mut bytes = std::fs::read(&path).unwrap();
                let middle = bytes.len() / 3;
                bytes[middle..middle + 64].fill(0xAB);
                std::fs::write(&path, bytes).unwrap();
                damaged += 1;
            }
        }
        assert!(damaged > 0, "no table file written");
        let err = match Store::open(dir.path(), Options::default(), families(), Durability::InputLog) {
            Err(err) => err,
            Ok(store) => {
                let cf = store.cf("state").unwrap();
                let read: Result<Vec<_>> =
                    store.db().iterator_cf(cf, rocksdb::IteratorMode::Start).map(|item| Ok(item?)).collect();
                read.expect_err("a damaged table read whole")
            }
        };
        assert!(err.is_corruption(), "{err}");
        assert!(!Error::Store("a column family missing".into()).is_corruption());
    }

    #[test]
    fn state_commits_with_its_progress_and_a_skip_moves_only_forward() {
        let dir = tempfile::tempdir().unwrap();
        let families = || vec![ColumnFamilyDescriptor::new("state", Options::default())];
        let source = Source { stream: Source::SHARD, partition: 2 };
        {
            let store = Store::open(dir.path(), Options::default(), families(), Durability::InputLog).unwrap();
            assert_eq!(store.progress(), Progress::default());
            let mut batch = WriteBatch::default();
            batch.put_cf(store.cf("state").unwrap(), b"k", b"v");
            let mut progress = Progress { next_offset: Some(42), ..Default::default() };
            progress.advance(source, Stamp { offset: 7, index: 2 });
            store.commit(batch, progress).unwrap();
            assert!(store.skip_record(40).is_err(), "40 was applied");
            store.skip_record(41).unwrap(); // already past it: a skip carried out again
            store.skip_record(45).unwrap();
        }
        let store = Store::open(dir.path(), Options::default(), families(), Durability::InputLog).unwrap();
        let progress = store.progress();
        assert_eq!((progress.next_offset, progress.high_water[&source]), (Some(46), Stamp { offset: 7, index: 2 }));
        assert_eq!(store.db().get_cf(store.cf("state").unwrap(), b"k").unwrap().as_deref(), Some(&b"v"[..]));
    }

    #[test]
    fn a_snapshot_reads_the_state_of_its_offset_while_commits_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let families = vec![ColumnFamilyDescriptor::new("state", Options::default())];
        let store = Store::open(dir.path(), Options::default(), families, Durability::InputLog).unwrap();
        let commit = |value: &[u8], next: i64| {
            let mut batch = WriteBatch::default();
            batch.put_cf(store.cf("state").unwrap(), b"k", value);
            store.commit(batch, Progress { next_offset: Some(next), ..Default::default() }).unwrap();
        };
        commit(b"first", 5);
        let (snapshot, next) = store.snapshot();
        commit(b"second", 6);
        let mut read = rocksdb::ReadOptions::default();
        read.set_snapshot(&snapshot);
        let value = store.db().get_cf_opt(store.cf("state").unwrap(), b"k", &read).unwrap();
        assert_eq!((value.as_deref(), next), (Some(&b"first"[..]), Some(5)));
        assert_eq!(store.next_offset(), Some(6));
    }

    /// Set in a child process (this test binary run again): which crash to stage, and
    /// where.
    const CRASH_CHILD: &str = "TALLY_TEST_STORE_CRASH";

    fn crash_families() -> Vec<ColumnFamilyDescriptor> {
        let mut state = Options::default();
        state.set_write_buffer_size(64 << 10);
        vec![ColumnFamilyDescriptor::new("state", state)]
    }

    /// Commits `next_offset` 1..=`batches`, batch `i` writing state key `i` (a
    /// kilobyte), persisting after `persist_at`; then dies without closing the store.
    fn commit_and_die(dir: &Path, durability: Durability, batches: i64, persist_at: Option<i64>) -> ! {
        let store = Store::open(dir, Options::default(), crash_families(), durability).unwrap();
        for i in 1..=batches {
            let mut batch = WriteBatch::default();
            batch.put_cf(store.cf("state").unwrap(), i.to_be_bytes(), [7u8; 1024]);
            store.commit(batch, Progress { next_offset: Some(i), ..Default::default() }).unwrap();
            if persist_at == Some(i) {
                store.persist().unwrap();
            }
        }
        std::process::abort()
    }

    /// What a store holds after a child staged `scenario` in it and died: its
    /// progress and the state keys it has.
    fn after_crash(scenario: &str) -> (Option<i64>, Vec<i64>) {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["store::tests::a_crash_leaves_a_commit_whole_and_loses_only_what_the_durability_allows", "--exact"])
            .env(CRASH_CHILD, format!("{scenario}:{}", dir.path().display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!status.success(), "the child of {scenario} died");
        let store = Store::open(dir.path(), Options::default(), crash_families(), Durability::Wal).unwrap();
        let keys = store
            .db()
            .iterator_cf(store.cf("state").unwrap(), rocksdb::IteratorMode::Start)
            .map(|entry| i64::from_be_bytes(entry.unwrap().0[..8].try_into().unwrap()))
            .collect();
        (store.progress().next_offset, keys)
    }

    #[test]
    fn a_crash_leaves_a_commit_whole_and_loses_only_what_the_durability_allows() {
        if let Ok(staged) = std::env::var(CRASH_CHILD) {
            let (scenario, dir) = staged.split_once(':').unwrap();
            let dir = Path::new(dir);
            match scenario {
                "wal" => commit_and_die(dir, Durability::Wal, 20, None),
                "input-log" => commit_and_die(dir, Durability::InputLog, 20, Some(10)),
                "input-log-full" => commit_and_die(dir, Durability::InputLog, 300, None),
                other => panic!("no scenario {other}"),
            }
        }
        // With the WAL every commit survives.
        assert_eq!(after_crash("wal"), (Some(20), (1..=20).collect()));
        // Without it, what was persisted, and nothing after it (the input replays that).
        assert_eq!(after_crash("input-log"), (Some(10), (1..=10).collect()));
        // Without it, a column family that filled up flushed with the progress: the
        // state and its progress agree, at some commit past the first flush.
        let (next, keys) = after_crash("input-log-full");
        let next = next.expect("the 300 KB of state filled its 64 KB memtable: something was flushed");
        assert_eq!(keys, (1..=next).collect::<Vec<_>>(), "the state of exactly the commits up to the progress");
    }
}

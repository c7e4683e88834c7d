//! The shard's descendant views — desc(origin) of every origin it owns — in memory,
//! and how they are made durable: a record of descendant changes is logged whole,
//! not written view by view.
//!
//! An edge high in the graph changes the view of every one of its ancestors (1 011
//! of them in `tally-bench graph`'s latency shape); writing each view in the
//! record's write batch would be a third of the record's time on the counter. Instead
//! the record's accepted changes go into the `desc_log` column family under the
//! record's offset, in the same write batch as the counts and the progress they
//! belong to — so a crash keeps both or neither. Once the log holds
//! [`StoreOptions::view_log_bytes`](crate::store::StoreOptions) the record that
//! crosses it folds it instead: the current view of every origin changed since the
//! last fold is written to `desc`, and the log is deleted, in that record's write
//! batch. Opening a store reads `desc`, then replays the log in offset order.
//!
//! A logged value is a shard record of descendant changes (versioned like any
//! shard record): the record's own bytes when every change in it was accepted,
//! else the accepted ones re-encoded. One that does not decode fails the open.

use std::collections::{HashMap, HashSet};

use rocksdb::{ColumnFamily, WriteBatch};
use tally_core::graph::{apply_change, DescChangeRef};
use tally_core::wire::ShardMessageRef;
use tally_shared::store::Store;

use crate::error::Result;
use crate::store::{CF_DESC, CF_DESC_LOG};

/// The key of the logged record at shard-topic `offset` (offsets are never
/// negative: they sort as unsigned).
fn log_key(offset: i64) -> [u8; 8] {
    (offset as u64).to_be_bytes()
}

/// Every origin's descendant view and what of it is only in the log.
#[derive(Debug, Default)]
pub struct Views {
    /// desc(origin) of every origin with descendants, sorted.
    pub map: HashMap<String, Vec<String>>,
    /// Origins changed since the log was last folded into `desc`.
    unfolded: HashSet<String>,
    /// Bytes in the log.
    logged_bytes: usize,
}

impl Views {
    /// The views as committed: `desc`, then the log replayed.
    pub fn load(store: &Store) -> Result<Self> {
        let mut views = Views::default();
        for item in store.db().iterator_cf(store.cf(CF_DESC)?, rocksdb::IteratorMode::Start) {
            let (key, value) = item?;
            let origin = String::from_utf8(key.to_vec())
                .map_err(|_| tally_core::Error::Format(format!("descendant view key {key:?}: not UTF-8")))?;
            views.map.insert(origin, tally_core::keys::decode_names(&value)?);
        }
        for item in store.db().iterator_cf(store.cf(CF_DESC_LOG)?, rocksdb::IteratorMode::Start) {
            let (key, value) = item?;
            let entries = match ShardMessageRef::decode(&value)? {
                ShardMessageRef::DescChanges { entries, .. } => entries,
                _ => {
                    let message = format!("descendant view log at {key:?}: not a record of descendant changes");
                    return Err(tally_core::Error::Format(message).into());
                }
            };
            for (_, change) in &entries {
                views.change(change);
            }
            views.logged_bytes += value.len();
        }
        Ok(views)
    }

    /// Applies `change` to its origin's view in memory (it is made durable by
    /// [`Views::persist`]).
    pub fn change(&mut self, change: &DescChangeRef<'_>) {
        let origin = change.origin;
        let view = match self.map.get_mut(origin) {
            Some(view) => view,
            None => self.map.entry(origin.to_string()).or_default(),
        };
        apply_change(view, &change.added, &change.removed);
        if view.is_empty() {
            self.map.remove(origin);
        }
        if !self.unfolded.contains(origin) {
            self.unfolded.insert(origin.to_string());
        }
    }

    /// Makes the changes of the record at `offset` durable in `batch`: logs
    /// `logged` (a shard record of them), or folds the log when it would pass
    /// `fold_bytes`. What it did counts once the batch is committed
    /// ([`Views::committed`]): a batch that fails leaves the log as it was on disk,
    /// so its bookkeeping stays too.
    pub fn persist(
        &self,
        batch: &mut WriteBatch,
        (desc_cf, log_cf): (&ColumnFamily, &ColumnFamily),
        offset: i64,
        logged: &[u8],
        fold_bytes: usize,
    ) -> Result<Persisted> {
        if self.logged_bytes + logged.len() <= fold_bytes {
            batch.put_cf(log_cf, log_key(offset), logged);
            return Ok(Persisted::Logged(logged.len()));
        }
        let mut origins: Vec<&String> = self.unfolded.iter().collect();
        origins.sort_unstable();
        let mut encoded = Vec::new();
        for origin in origins {
            match self.map.get(origin) {
                Some(view) => {
                    encoded.clear();
                    tally_core::keys::encode_names_into(view, &mut encoded)?;
                    batch.put_cf(desc_cf, origin.as_bytes(), &encoded);
                }
                None => batch.delete_cf(desc_cf, origin.as_bytes()),
            }
        }
        batch.delete_range_cf(log_cf, log_key(0), log_key(i64::MAX));
        Ok(Persisted::Folded)
    }

    /// The batch [`Views::persist`] wrote into is committed.
    pub fn committed(&mut self, persisted: Persisted) {
        match persisted {
            Persisted::Logged(bytes) => self.logged_bytes += bytes,
            Persisted::Folded => {
                self.unfolded.clear();
                self.logged_bytes = 0;
            }
        }
    }
}

/// What [`Views::persist`] wrote: a log entry of so many bytes, or a fold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Persisted {
    Logged(usize),
    Folded,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use tally_core::graph::DescChange;
    use tally_core::wire::{ShardMessage, Source, Stamp};

    use super::*;
    use crate::store::apply::ShardRecord;
    use crate::store::{ShardStore, StoreOptions};

    const NOW: i64 = 1_763_780_000_000;

    /// A record of changes `(origin, added, removed)` over `o0..o3` → `d0..d3`,
    /// stamped from `(offset, 0)` on; `stale` entries get stamps already applied.
    fn record(offset: i64, changes: &[(u8, Vec<u8>, Vec<u8>)], stale: usize) -> (Vec<u8>, Vec<DescChange>) {
        let names = |list: &[u8]| {
            let mut names: Vec<String> = list.iter().map(|d| format!("d{d}")).collect();
            names.sort();
            names.dedup();
            names
        };
        let mut accepted = Vec::new();
        let entries = changes
            .iter()
            .enumerate()
            .map(|(index, (origin, added, removed))| {
                let added = names(added);
                let removed = names(removed).into_iter().filter(|d| !added.contains(d)).collect();
                let change = DescChange { origin: format!("o{origin}"), added, removed };
                // The first `stale` entries repeat the first stamp of record 0.
                let stamp = match index < stale && offset > 0 {
                    true => Stamp { offset: 0, index: 0 },
                    false => {
                        accepted.push(change.clone());
                        Stamp { offset, index: index as u32 }
                    }
                };
                (stamp, change)
            })
            .collect();
        let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
        (ShardMessage::DescChanges { source, entries }.encode().unwrap(), accepted)
    }

    /// A change `(origin, added, removed)`.
    type Change = (u8, Vec<u8>, Vec<u8>);

    /// Records of changes, each with how many of its first entries are stale.
    fn changes() -> impl Strategy<Value = Vec<(Vec<Change>, usize)>> {
        let names = || proptest::collection::vec(0..4u8, 0..3);
        let change = (0..4u8, names(), names());
        proptest::collection::vec((proptest::collection::vec(change, 1..5), 0..2usize), 1..16)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Whether the log folds after every record, now and then or never, the
        /// views after reopening the store are the changes applied in order (each
        /// once: redelivered entries are not logged).
        #[test]
        fn views_survive_reopening_logged_or_folded(records in changes(), fold in prop_oneof![Just(0usize), 1usize..400, Just(1usize << 30)]) {
            let dir = tempfile::tempdir().unwrap();
            let options = StoreOptions { view_log_bytes: fold, ..StoreOptions::default() };
            let mut model: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (offset, (changes, stale)) in records.iter().enumerate() {
                let store = ShardStore::open(0, dir.path(), options.clone()).unwrap();
                let (payload, accepted) = record(offset as i64, changes, *stale);
                let report = store.apply(&[ShardRecord { offset: offset as i64, payload: &payload, timestamp: None }], NOW, false).unwrap();
                prop_assert_eq!(report.desc_changes, accepted.len() as u64);
                for change in &accepted {
                    let view = model.entry(change.origin.clone()).or_default();
                    apply_change(view, &change.added, &change.removed);
                }
                model.retain(|_, view| !view.is_empty());
                drop(store);
                let store = ShardStore::open(0, dir.path(), options.clone()).unwrap();
                let views: BTreeMap<String, Vec<String>> = store.views().map.clone().into_iter().collect();
                prop_assert_eq!(&views, &model, "after record {}", offset);
            }
        }
    }

    #[test]
    fn a_log_entry_that_is_not_a_record_of_changes_fails_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions { view_log_bytes: 1 << 20, ..StoreOptions::default() };
        {
            let store = ShardStore::open(0, dir.path(), options.clone()).unwrap();
            let (payload, _) = record(0, &[(0, vec![1], vec![])], 0);
            store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, false).unwrap();
            let log = store.cf(CF_DESC_LOG).unwrap();
            store.store.db().put_cf(log, log_key(1), [1u8, 0xff, 0xff]).unwrap();
        }
        let Err(err) = ShardStore::open(0, dir.path(), options) else { panic!("a corrupt log must fail the open") };
        assert!(err.to_string().contains("shard record"), "{err}");
    }
}

//! Applying a batch of shard records to a shard store, exactly once.
//!
//! A record is skipped when its offset is below the store's `next_offset` (Kafka
//! redelivered it); an entry is skipped when its stamp is at or below its source's
//! high-water mark (the ingester sent it again after a restart) or when its
//! `(entity, id)` was seen within the dedupe window (the producer retried). What
//! remains is coalesced per bucket and written with the new progress in one RocksDB
//! write batch, so a crash at any moment leaves either all of it or none.

use std::collections::HashSet;

use rocksdb::WriteBatch;
use tally_shared::counting::Coalescer;
use tally_shared::keys::{encode_count_key, encode_dedupe_key, Counts};
use tally_shared::wire::ShardMessageRef;

use crate::error::Result;
use crate::store::{ShardStore, CF_COUNTS, CF_DEDUPE};

/// One record of the shard topic.
#[derive(Debug, Clone, Copy)]
pub struct ShardRecord<'a> {
    pub offset: i64,
    pub payload: &'a [u8],
}

/// What one batch did.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub records: usize,
    /// Records already applied (offset below `next_offset`).
    pub stale_records: usize,
    /// Records that are not shard messages: logged and skipped.
    pub undecodable_records: usize,
    pub increments: u64,
    /// Entries at or below their source's high-water stamp.
    pub redelivered: u64,
    /// Entries whose `(entity, id)` was seen within the dedupe window.
    pub duplicate_ids: u64,
    /// Distinct bucket keys written.
    pub keys: usize,
    /// The count keys the batch changed (for rollups); filled only when asked for.
    pub changed: Vec<Vec<u8>>,
}

impl ShardStore {
    /// Applies `records` (in offset order) at wall-clock `now`.
    pub fn apply(&self, records: &[ShardRecord<'_>], now: i64, collect_changes: bool) -> Result<ApplyReport> {
        let mut report = ApplyReport { records: records.len(), ..Default::default() };
        let mut progress = self.progress();
        let mut coalescer = Coalescer::new(&self.options.resolutions, now);
        let mut batch = WriteBatch::default();
        let mut ids_in_batch: HashSet<(&str, &str)> = HashSet::new();
        let mut key = Vec::with_capacity(128);
        let dedupe_cf = self.cf(CF_DEDUPE)?;

        for record in records {
            if progress.next_offset.is_some_and(|next| record.offset < next) {
                report.stale_records += 1;
                continue;
            }
            progress.next_offset = Some(record.offset + 1);
            let message = match ShardMessageRef::decode(record.payload) {
                Ok(message) => message,
                Err(err) => {
                    tracing::error!(shard = self.shard, offset = record.offset, error = %err, "skipping undecodable shard record");
                    report.undecodable_records += 1;
                    continue;
                }
            };
            let ShardMessageRef::Increments { source, entries } = message;
            for (stamp, increment) in entries {
                if progress.high_water.get(&source).is_some_and(|high_water| stamp <= *high_water) {
                    report.redelivered += 1;
                    continue;
                }
                progress.high_water.insert(source, stamp);
                if let Some(id) = increment.id {
                    key.clear();
                    encode_dedupe_key(&mut key, increment.entity, id);
                    if !ids_in_batch.insert((increment.entity, id)) || self.seen_recently(&key, now)? {
                        report.duplicate_ids += 1;
                        continue;
                    }
                    batch.put_cf(dedupe_cf, &key, now.to_le_bytes());
                }
                report.increments += 1;
                coalescer.add(
                    increment.entity,
                    increment.metric,
                    increment.ts,
                    Counts { direct: increment.delta, total: increment.delta },
                );
            }
        }

        let counts_cf = self.cf(CF_COUNTS)?;
        report.keys = coalescer.keys();
        coalescer.for_each(|entity, metric, width_ms, bucket, counts| {
            key.clear();
            encode_count_key(&mut key, entity, metric, width_ms, bucket);
            batch.merge_cf(counts_cf, &key, counts.encode());
            if collect_changes {
                report.changed.push(key.clone());
            }
        });
        self.commit(batch, progress)?;
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use tally_shared::keys::ALL_TIME_WIDTH;
    use tally_shared::time::Resolutions;
    use tally_shared::wire::{Increment, ShardMessage, Source, Stamp};

    use super::*;
    use crate::store::StoreOptions;

    const NOW: i64 = 1_763_780_000_000;

    fn options() -> StoreOptions {
        StoreOptions { resolutions: Resolutions::default(), dedupe_window_ms: 86_400_000, sync_writes: false }
    }

    fn message(partition: u32, entries: &[(i64, u32, &str, i64, Option<&str>)]) -> Vec<u8> {
        ShardMessage::Increments {
            source: Source { stream: Source::INCREMENTS, partition },
            entries: entries
                .iter()
                .map(|&(offset, index, entity, delta, id)| {
                    (
                        Stamp { offset, index },
                        Increment {
                            entity: entity.into(),
                            metric: "views".into(),
                            delta,
                            ts: NOW,
                            id: id.map(Into::into),
                        },
                    )
                })
                .collect(),
        }
        .encode()
        .unwrap()
    }

    fn all_time(store: &ShardStore, entity: &str) -> i64 {
        let mut key = Vec::new();
        encode_count_key(&mut key, entity, "views", ALL_TIME_WIDTH, 0);
        store.get_counts(&[key]).unwrap()[0].direct
    }

    #[test]
    fn redelivered_records_and_entries_count_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(10, 0, "a", 1, None), (10, 1, "a", 2, None), (11, 0, "b", 5, None)]);
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first }], NOW, false).unwrap();
        assert_eq!(report.increments, 3);
        // Kafka redelivers offset 0: skipped by offset.
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first }], NOW, false).unwrap();
        assert_eq!(report.stale_records, 1);
        // The ingester re-sent the same entries plus a new one at a new offset.
        let again = message(0, &[(10, 1, "a", 2, None), (11, 0, "b", 5, None), (12, 0, "a", 100, None)]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &again }], NOW, false).unwrap();
        assert_eq!((report.redelivered, report.increments), (2, 1));
        assert_eq!(all_time(&store, "a"), 103);
        assert_eq!(all_time(&store, "b"), 5);
        // Another source's stamps are independent.
        let other = message(1, &[(10, 0, "a", 1000, None)]);
        store.apply(&[ShardRecord { offset: 2, payload: &other }], NOW, false).unwrap();
        assert_eq!(all_time(&store, "a"), 1103);
    }

    #[test]
    fn first_entry_of_a_new_source_counts() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(0, 0, "a", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first }], NOW, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (1, 0));
        let same = message(0, &[(0, 0, "a", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &same }], NOW, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (0, 1));
    }

    #[test]
    fn ids_deduplicate_within_and_across_batches_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = ShardStore::open(0, dir.path(), options()).unwrap();
            let payload =
                message(0, &[(1, 0, "a", 1, Some("x")), (2, 0, "a", 1, Some("x")), (3, 0, "b", 1, Some("x"))]);
            let report = store.apply(&[ShardRecord { offset: 0, payload: &payload }], NOW, false).unwrap();
            assert_eq!((report.increments, report.duplicate_ids), (2, 1));
        }
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let payload = message(0, &[(4, 0, "a", 1, Some("x")), (5, 0, "a", 1, Some("y"))]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &payload }], NOW, false).unwrap();
        assert_eq!((report.increments, report.duplicate_ids), (1, 1));
        // Past the window the id counts again.
        let payload = message(0, &[(6, 0, "a", 1, Some("x"))]);
        let report = store.apply(&[ShardRecord { offset: 2, payload: &payload }], NOW + 86_400_000, false).unwrap();
        assert_eq!(report.increments, 1);
        assert_eq!(all_time(&store, "a"), 3);
    }

    #[test]
    fn garbage_records_are_skipped_but_consumed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let good = message(0, &[(1, 0, "a", 1, None)]);
        let records = [ShardRecord { offset: 5, payload: b"garbage" }, ShardRecord { offset: 6, payload: &good }];
        let report = store.apply(&records, NOW, true).unwrap();
        assert_eq!((report.undecodable_records, report.increments), (1, 1));
        assert_eq!(store.progress().next_offset, Some(7));
        assert_eq!(report.changed.len(), 4);
    }
}

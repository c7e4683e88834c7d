//! What a shard store keeps to publish its rollups ([`crate::rollups`]): which
//! buckets are still to go (marks), when each published bucket expires (its
//! deadline: then it goes as a tombstone), and when every live bucket last went
//! again whole (a refresh: the rollups topic deletes records older than its
//! retention, so a value that stopped changing is published again before that).
//!
//! Marks are written with the counts that changed them ([`crate::store::apply`]) and by a
//! refresh; deadlines when a bucket's value is acknowledged. Both are bookkeeping:
//! a lost one costs a repeat, never a count.

use std::sync::atomic::Ordering;

use rocksdb::WriteBatch;
use tally_core::format::{check_present, decode_i64_value, i64_value, PRESENT};
use tally_core::keys::{parse_count_key, CountKey, ALL_TIME_WIDTH};

use crate::error::Result;
use crate::store::{ShardStore, CF_COUNTS, CF_ROLLUPS, CF_ROLLUP_DEADLINES};

/// How long after a bucket expired a batch that meets it (a late event, a replay
/// after a handover) still marks it, for a tombstone: an owner that published the
/// bucket and lost the shard before it expired left no deadline here. A rebuild
/// from a long log so publishes at most this much of its expired buckets again.
pub const TOMBSTONE_WINDOW_MS: i64 = 3_600_000;

/// When the last refresh marked every live bucket (ms), in the default family.
const KEY_ROLLUPS_REFRESHED: &[u8] = b"rollups_refreshed";
/// Marks written per batch by a refresh.
const REFRESH_BATCH: usize = 10_000;

/// Count keys read with their values and the shard's position: every shard-topic
/// record before `offset` applied, none after.
pub struct RollupPage {
    pub keys: Vec<Vec<u8>>,
    pub values: Vec<Option<Vec<u8>>>,
    pub offset: i64,
}

/// A deadline's key: the time (ms, big-endian with the sign bit flipped: ordered)
/// then the count key.
fn deadline_key(at: i64, count_key: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(8 + count_key.len());
    key.extend_from_slice(&((at as u64) ^ (1 << 63)).to_be_bytes());
    key.extend_from_slice(count_key);
    key
}

fn deadline_time(key: &[u8]) -> Option<i64> {
    Some((u64::from_be_bytes(key.get(..8)?.try_into().ok()?) ^ (1 << 63)) as i64)
}

impl ShardStore {
    /// The first `limit` count keys whose latest values are still to be published
    /// as rollups, in key order: marked with the counts that changed them, unmarked
    /// once published.
    pub fn pending_rollups(&self, limit: usize) -> Result<Vec<Vec<u8>>> {
        self.pending_rollups_after(None, limit)
    }

    /// [`ShardStore::pending_rollups`] strictly after key `after`.
    pub fn pending_rollups_after(&self, after: Option<&[u8]>, limit: usize) -> Result<Vec<Vec<u8>>> {
        let mode = match after {
            Some(key) => rocksdb::IteratorMode::From(key, rocksdb::Direction::Forward),
            None => rocksdb::IteratorMode::Start,
        };
        let mut keys = Vec::new();
        let items = self.store.db().iterator_cf(self.cf(CF_ROLLUPS)?, mode);
        for item in items.filter(|item| !matches!((item, after), (Ok((key, _)), Some(a)) if &key[..] == a)).take(limit)
        {
            let (key, value) = item?;
            check_present(&value, "rollup mark")?;
            keys.push(key.to_vec());
        }
        Ok(keys)
    }

    /// The values of `keys` (`None`: not stored) and the position they were read
    /// at, from one snapshot.
    pub fn rollup_page(&self, keys: Vec<Vec<u8>>) -> Result<RollupPage> {
        let (snapshot, next) = self.store.snapshot();
        let cf = self.cf(CF_COUNTS)?;
        let mut read = rocksdb::ReadOptions::default();
        read.set_snapshot(&snapshot);
        let values = self.store.db().batched_multi_get_cf_opt(cf, keys.iter().map(Vec::as_slice), false, &read);
        let values = values.into_iter().map(|value| Ok(value?.map(|v| v.to_vec()))).collect::<Result<_>>()?;
        Ok(RollupPage { keys, values, offset: next.unwrap_or(0) })
    }

    /// When the bucket of `key` expires (none: the all-time bucket never does; a
    /// width no longer configured has expired).
    pub fn expires_at(&self, key: &CountKey<'_>) -> Option<i64> {
        if key.width_ms == ALL_TIME_WIDTH {
            return None;
        }
        Some(self.options.resolutions.by_width(key.width_ms).map_or(i64::MIN, |resolution| {
            key.bucket.saturating_add(resolution.width_ms).saturating_add(resolution.retention_ms)
        }))
    }

    /// Whether the bucket of `key` is kept at `now`.
    pub fn live_at(&self, key: &CountKey<'_>, now: i64) -> bool {
        self.expires_at(key).is_none_or(|at| at > now)
    }

    /// Records what the broker acknowledged of `page`, published at `now`: each
    /// key whose value is still the one published is unmarked (a key a later batch
    /// changed keeps its mark), and each live bucket's deadline is set.
    pub fn rollups_published(&self, page: RollupPage, now: i64) -> Result<()> {
        let deadlines_cf = self.cf(CF_ROLLUP_DEADLINES)?;
        let mut deadlines = WriteBatch::default();
        for key in &page.keys {
            let counted = parse_count_key(key)?;
            if let Some(at) = self.expires_at(&counted).filter(|&at| at > now) {
                deadlines.put_cf(deadlines_cf, deadline_key(at, key), PRESENT);
            }
        }
        // Before the marks go: a crash in between publishes again, and sets them then.
        self.store.bookkeeping(deadlines)?;
        let published: Vec<(Vec<u8>, Option<Vec<u8>>)> = page.keys.into_iter().zip(page.values).collect();
        // The marked set first, then (inside) the commit lock: the order a batch
        // takes them in (see `marks`).
        let mut marked = self.marked();
        for at in self.store.unmark_unchanged(CF_ROLLUPS, CF_COUNTS, &published)? {
            marked.remove(&published[at].0);
        }
        Ok(())
    }

    /// Up to `limit` deadlines due at `now`, in time order: `(deadline key, count
    /// key)`.
    pub fn due_rollups(&self, now: i64, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut due = Vec::new();
        // From the last deadline done on (those before it are deleted: their
        // tombstones need not be stepped over again; a deadline written later is
        // past `now`, so after it), up to `now`.
        let mut read = rocksdb::ReadOptions::default();
        read.set_iterate_lower_bound(deadline_key(self.deadlines_done_until.load(Ordering::Relaxed), &[]));
        read.set_iterate_upper_bound(deadline_key(now.saturating_add(1), &[]));
        let deadlines = self.cf(CF_ROLLUP_DEADLINES)?;
        for item in self.store.db().iterator_cf_opt(deadlines, read, rocksdb::IteratorMode::Start) {
            let (key, value) = item?;
            check_present(&value, "rollup deadline")?;
            let at = deadline_time(&key)
                .ok_or_else(|| tally_core::Error::Format(format!("rollup deadline {key:?}: shorter than its time")))?;
            if at > now || due.len() == limit {
                break;
            }
            due.push((key.to_vec(), key[8..].to_vec()));
        }
        Ok(due)
    }

    /// Drops deadlines whose buckets were published as they stood then (the
    /// earliest due first: [`ShardStore::due_rollups`]).
    pub fn deadlines_done(&self, deadline_keys: &[Vec<u8>]) -> Result<()> {
        self.store.delete(CF_ROLLUP_DEADLINES, deadline_keys)?;
        if let Some(last) = deadline_keys.iter().filter_map(|key| deadline_time(key)).max() {
            self.deadlines_done_until.fetch_max(last, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Marks every live bucket for publishing when the last refresh is `every_ms`
    /// old at `now`, or there was none (a store from before refreshes: what it
    /// published then has no deadline, and the rollups topic would delete its
    /// unchanging values); how many were marked.
    pub fn refresh_rollups(&self, now: i64, every_ms: i64) -> Result<Option<usize>> {
        let last = self.store.db().get(KEY_ROLLUPS_REFRESHED)?;
        let last = last.map(|bytes| decode_i64_value(&bytes, "rollups_refreshed")).transpose()?;
        if last.is_some_and(|at| now.saturating_sub(at) < every_ms) {
            return Ok(None);
        }
        let rollups_cf = self.cf(CF_ROLLUPS)?;
        let mut batch = WriteBatch::default();
        let mut marked = 0;
        // A scan of every bucket once in a while: it does not evict the hot blocks.
        let mut read = rocksdb::ReadOptions::default();
        read.fill_cache(false);
        for item in self.store.db().iterator_cf_opt(self.cf(CF_COUNTS)?, read, rocksdb::IteratorMode::Start) {
            let (key, _) = item?;
            let count_key = parse_count_key(&key)?;
            // Segment combinations have no rollups (their metric's keys have).
            if tally_core::segments::Combination::of(count_key.metric).is_none() && self.live_at(&count_key, now) {
                batch.put_cf(rollups_cf, &key, PRESENT);
                marked += 1;
            }
            if batch.len() == REFRESH_BATCH {
                self.store.bookkeeping(std::mem::take(&mut batch))?;
            }
        }
        self.store.bookkeeping(batch)?;
        self.store.put_meta(KEY_ROLLUPS_REFRESHED, &i64_value(now))?;
        Ok(Some(marked))
    }
}

#[cfg(test)]
mod tests {
    use tally_core::keys::encode_count_key;

    use super::*;

    const NOW: i64 = 1_763_780_000_000;
    const MINUTE: i64 = 60_000;

    fn key(width_ms: i64, bucket: i64) -> Vec<u8> {
        let mut key = Vec::new();
        encode_count_key(&mut key, "e", "m", width_ms, bucket);
        key
    }

    #[test]
    fn deadline_keys_order_by_time_then_key() {
        let (a, b) = (key(MINUTE, 0), key(MINUTE, MINUTE));
        let mut keys = [deadline_key(5, &a), deadline_key(-5, &b), deadline_key(5, &b), deadline_key(-6, &a)];
        keys.sort();
        let times: Vec<_> = keys.iter().map(|k| (deadline_time(k).unwrap(), k[8..].to_vec())).collect();
        assert_eq!(times, vec![(-6, a.clone()), (-5, b.clone()), (5, a), (5, b)]);
    }

    /// A published bucket's deadline is its expiry; the all-time bucket has none;
    /// due deadlines come in time order, up to the limit, and go once done.
    #[test]
    fn published_buckets_fall_due_when_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let events = [("e", 1, NOW), ("e", 1, NOW - 30 * MINUTE)];
        let shards = crate::shards::one_shard_with(dir.path(), &events, NOW, true);
        let store = shards.get(0).unwrap();
        let marked = store.pending_rollups(usize::MAX).unwrap();
        let page = store.rollup_page(marked.clone()).unwrap();
        assert_eq!(page.offset, store.next_offset().unwrap());
        assert!(page.values.iter().all(Option::is_some));
        store.rollups_published(page, NOW).unwrap();
        assert_eq!(store.pending_rollups(usize::MAX).unwrap(), Vec::<Vec<u8>>::new());
        let mut want: Vec<(i64, Vec<u8>)> =
            marked.iter().filter_map(|k| Some((store.expires_at(&parse_count_key(k).unwrap())?, k.clone()))).collect();
        want.sort();
        assert_eq!(want.len(), marked.len() - 1, "a deadline for every bucket but the all-time one");
        let due = |now| store.due_rollups(now, usize::MAX).unwrap();
        assert_eq!(due(want[0].0 - 1), vec![]);
        let first = due(want[0].0);
        assert_eq!(first, vec![(deadline_key(want[0].0, &want[0].1), want[0].1.clone())]);
        let all = due(i64::MAX);
        assert_eq!(
            all.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>(),
            want.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>()
        );
        assert_eq!(store.due_rollups(i64::MAX, 2).unwrap(), all[..2].to_vec());
        store.deadlines_done(&[first[0].0.clone()]).unwrap();
        assert_eq!(due(i64::MAX), all[1..].to_vec());
    }

    /// An event in a minute bucket that expired half an hour ago counts in its
    /// hour, day and all-time buckets, and marks the minute bucket (no counts) for
    /// its tombstone; one that expired two hours ago marks nothing.
    #[test]
    fn a_bucket_that_expired_lately_is_marked_without_counts() {
        let dir = tempfile::tempdir().unwrap();
        let hour = 60 * MINUTE;
        let (lately, long_ago) = (NOW - 6 * hour - 31 * MINUTE, NOW - 8 * hour - MINUTE);
        let shards = crate::shards::one_shard_with(dir.path(), &[("e", 1, lately), ("f", 1, long_ago)], NOW, true);
        let store = shards.get(0).unwrap();
        let marked = store.pending_rollups(usize::MAX).unwrap();
        let widths = |entity: &str| -> Vec<i64> {
            let keys = marked.iter().map(|k| parse_count_key(k).unwrap());
            keys.filter(|k| k.entity == entity).map(|k| k.width_ms).collect()
        };
        assert_eq!((widths("e"), widths("f")), (vec![0, MINUTE, hour, 24 * hour], vec![0, hour, 24 * hour]));
        let page = store.rollup_page(marked).unwrap();
        let stored: Vec<bool> = page.values.iter().map(Option::is_some).collect();
        assert_eq!(stored, vec![true, false, true, true, true, true, true], "the expired minute has no counts");
    }

    #[test]
    fn a_refresh_marks_every_live_bucket_once_its_interval_passed() {
        let dir = tempfile::tempdir().unwrap();
        let events = [("e", 1, NOW), ("f", 2, NOW)];
        let shards = crate::shards::one_shard_with(dir.path(), &events, NOW, true);
        let store = shards.get(0).unwrap();
        let marked = store.pending_rollups(usize::MAX).unwrap();
        store.rollups_published(store.rollup_page(marked.clone()).unwrap(), NOW).unwrap();
        let every = 30 * 86_400_000;
        // The first refresh comes at once (a store from before them): every bucket.
        assert_eq!(store.refresh_rollups(NOW, every).unwrap(), Some(marked.len()));
        assert_eq!(store.pending_rollups(usize::MAX).unwrap(), marked);
        store.rollups_published(store.rollup_page(marked.clone()).unwrap(), NOW).unwrap();
        assert_eq!(store.refresh_rollups(NOW + every - 1, every).unwrap(), None);
        assert_eq!(store.pending_rollups(usize::MAX).unwrap(), Vec::<Vec<u8>>::new());
        // A day later the minute buckets have expired: the rest is marked again.
        let later = NOW + every;
        assert_eq!(store.refresh_rollups(later, every).unwrap(), Some(marked.len() - 2));
        let live: Vec<Vec<u8>> =
            marked.iter().filter(|k| store.live_at(&parse_count_key(k).unwrap(), later)).cloned().collect();
        assert_eq!(live.len(), marked.len() - 2, "the two minute buckets expired");
        assert_eq!(store.pending_rollups(usize::MAX).unwrap(), live);
        assert_eq!(store.refresh_rollups(later + 1, every).unwrap(), None, "once per interval");
    }

    /// A segmented increment marks its metric's buckets, never its combination's,
    /// when applied and when refreshed.
    #[test]
    fn segment_combinations_are_never_marked_for_rollups() {
        use tally_core::wire::{Increment, ShardMessage, Source, Stamp};
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::ShardStore::open(0, dir.path(), crate::store::StoreOptions::default()).unwrap();
        let metric = "views\u{1}state\u{1e}CA".to_string();
        let increment = Increment { entity: "e".into(), metric, delta: 1, ts: NOW, id: None };
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let payload = ShardMessage::Increments { source, entries: vec![(Stamp { offset: 0, index: 0 }, increment)] }
            .encode()
            .unwrap();
        store
            .apply(&[crate::store::apply::ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, true)
            .unwrap();
        let metrics = |keys: &[Vec<u8>]| -> Vec<String> {
            keys.iter().map(|k| parse_count_key(k).unwrap().metric.to_string()).collect()
        };
        let marked = store.pending_rollups(usize::MAX).unwrap();
        assert_eq!(metrics(&marked), vec!["views"; 4], "the metric's all-time and three buckets");
        store.rollups_published(store.rollup_page(marked.clone()).unwrap(), NOW).unwrap();
        assert_eq!(store.refresh_rollups(NOW, 86_400_000).unwrap(), Some(4));
        assert_eq!(metrics(&store.pending_rollups(usize::MAX).unwrap()), vec!["views"; 4]);
    }
}

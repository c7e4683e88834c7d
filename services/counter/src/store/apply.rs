//! Applying a batch of shard records to a shard store, exactly once.
//!
//! A record is skipped when its offset is below the store's `next_offset` (Kafka
//! redelivered it). A record that does not decode stops the batch there: what came
//! before it is committed, the store's `next_offset` stays at it, and the report
//! names it (the shard then fails; nothing past it is applied). An entry is skipped when its stamp is at or below its source's
//! high-water mark (its sender sent it again after a restart) or when its
//! `(entity, id)` was seen within the dedupe window (the producer retried).
//!
//! Three kinds of records (see [`ShardMessage`](tally_core::wire::ShardMessage)):
//! - increments add to direct and total of their counter and, through the shard's
//!   descendant view of the entity, to the totals of its descendants;
//! - totals from other shards add to totals here;
//! - descendant changes from `tally-graph` switch an origin's view and move its
//!   retained direct counts into the totals of the descendants gained and out of
//!   those lost ([`tally_core::propagation`]).
//!
//! Runs of increment and totals records are coalesced per bucket and written with
//! the new progress in one RocksDB write batch; a descendant-change record is its
//! own write batch, after the run before it is committed, because it reads the
//! origin's direct counts. Totals for descendants on other shards go into the
//! `outbox` in the same write batch, stamped with the record's offset and an index
//! per receiving shard, latest-expiring bucket first
//! ([`stamp_totals`](tally_core::propagation::stamp_totals)): a replay of the same
//! log — on another counter that restores or rebuilds the shard, at another clock
//! that keeps fewer or more buckets — stamps every total it sends as the first run
//! did, and the receivers drop what they had.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::sync::MutexGuard;

use rocksdb::properties::NUM_ENTRIES_ACTIVE_MEM_TABLE;
use rocksdb::WriteBatch;
use rustc_hash::FxHashMap;
use tally_core::counting::Coalescer;
use tally_core::format::PRESENT;
use tally_core::graph::DescChangeRef;
use tally_core::keys::{
    encode_count_key, encode_dedupe_key, encode_entity_prefix, parse_count_key, Count, Counts, ALL_TIME_WIDTH,
};
use tally_core::propagation::{change_deltas, stamp_totals};
use tally_core::records::split_by_size;
use tally_core::segments::Combination;
use tally_core::sharding::shard_of;
use tally_core::wire::{ShardMessage, ShardMessageRef, Source, Stamp, TotalDelta};
use tally_shared::dedupe::DedupeWindow;

use crate::direct::{DirectCache, EntityDirect, MetricBuckets};
use crate::error::Result;
use crate::marks::MarkedKeys;
use crate::operands::OperandTally;
use tally_shared::outbox::outbox_key;

use tally_shared::progress::Progress;

use crate::store::segments::{Admissions, Origin};
use crate::store::{ShardStore, CF_COUNTS, CF_DEDUPE, CF_DESC, CF_DESC_LOG, CF_OUTBOX, CF_ROLLUPS};

/// One record of the shard topic.
#[derive(Debug, Clone, Copy)]
pub struct ShardRecord<'a> {
    pub offset: i64,
    pub payload: &'a [u8],
    /// The record's timestamp: the time its input record was produced (the
    /// ingester sets it), which the dedupe window runs on. `None`: the apply time.
    pub timestamp: Option<i64>,
}

/// What one batch did.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub records: usize,
    /// Records already applied (offset below `next_offset`).
    pub stale_records: usize,
    /// The record that does not decode, and why: the batch stopped at it.
    pub undecodable: Option<(i64, String)>,
    /// `(next offset, offset found)`: the log skips records the store has not
    /// applied (deleted by retention, a recreated topic); the batch stopped there.
    pub gap: Option<(i64, i64)>,
    pub increments: u64,
    /// Entries at or below their source's high-water stamp.
    pub redelivered: u64,
    /// Entries whose `(entity, id)` was seen within the dedupe window.
    pub duplicate_ids: u64,
    /// Descendant-set changes applied.
    pub desc_changes: u64,
    /// Totals entries received from other shards and applied.
    pub totals_received: u64,
    /// Outbox messages written for other shards.
    pub outbox_messages: u64,
    /// Distinct bucket keys written.
    pub keys: usize,
    /// Rollup marks written: when asked for, every count key the batch changed is
    /// marked in the `rollups` column family in the same write batch (so a crash
    /// before they are published leaves them to publish after restart), unless its
    /// mark is known to be there already ([`crate::marks`]).
    pub marked: usize,
    /// Increments counted under their metric's overflow combination (the origin's
    /// combinations at their cap: [`crate::store::segments`]).
    pub segment_overflows: u64,
}

/// An origin's direct value per `(metric, width_ms, bucket)`; the metric is a
/// `start..end` range of [`Scratch::metrics`].
type DirectBuckets = Vec<(((u32, u32), i64, i64), Count)>;

/// Buffers one record of descendant changes reuses from origin to origin (what
/// still allocates: each sum's key, a delta for another shard, a metric new to the
/// record, an origin's entry in the cache, a view for a new origin).
#[derive(Default)]
struct Scratch {
    /// An origin read from the store: its key prefix, its buckets and, in
    /// `metrics`, the names their ranges point into.
    prefix: Vec<u8>,
    metrics: String,
    direct: DirectBuckets,
    /// The origin's retained buckets by metric number: what its changes move.
    numbered: Vec<((u32, i64, i64), Count)>,
    /// The names of the record's metrics, numbered in order of appearance (a
    /// record has few).
    metric_names: Vec<String>,
}

/// The number of metric `name` in `names`, added when new.
fn metric_number(names: &mut Vec<String>, name: &str) -> u32 {
    match names.iter().position(|known| known == name) {
        Some(at) => at as u32,
        None => {
            names.push(name.to_string());
            names.len() as u32 - 1
        }
    }
}

/// The rollup marks one write batch adds ([`crate::marks`]): holds the marked set
/// from its first look-up until [`Marking::committed`], after the batch's commit.
/// Without rollups it marks nothing and holds nothing.
struct Marking<'s> {
    marked: Option<MutexGuard<'s, MarkedKeys>>,
    written: Vec<u128>,
}

impl Marking<'_> {
    /// Marks `key` (of `metric`) in `batch` unless its mark is known to be committed
    /// already. Segment combinations have no rollups: their metric's key has.
    fn mark(&mut self, batch: &mut WriteBatch, rollups_cf: &rocksdb::ColumnFamily, metric: &str, key: &[u8]) {
        if Combination::of(metric).is_some() {
            return;
        }
        if let Some(marked) = &self.marked {
            let hash = marked.hash(key);
            if !marked.contains(hash) {
                batch.put_cf(rollups_cf, key, PRESENT);
                self.written.push(hash);
            }
        }
    }

    /// The batch is committed: its marks join the set (and the lock is let go).
    fn committed(self, report: &mut ApplyReport) {
        report.marked += self.written.len();
        if let Some(mut marked) = self.marked {
            marked.insert_committed(self.written);
        }
    }
}

/// The count keys one write batch changes ([`crate::operands`]): a merge operand
/// each, or, for a key that stacked up the most operands, its sum (its stored
/// value, read just before the commit, plus the delta). Holds the tally until
/// [`CountWrites::finish`].
struct CountWrites<'s> {
    tally: MutexGuard<'s, OperandTally>,
    sums: Vec<(Vec<u8>, Counts)>,
    /// The key last added (debug builds check the tally's premise: each key once per
    /// write batch; both callers add them in key order).
    #[cfg(debug_assertions)]
    last: Option<Vec<u8>>,
}

impl CountWrites<'_> {
    fn add(&mut self, batch: &mut WriteBatch, counts_cf: &rocksdb::ColumnFamily, key: &[u8], delta: Counts) {
        #[cfg(debug_assertions)]
        {
            debug_assert!(self.last.as_deref().is_none_or(|last| last < key), "count keys repeat in a write batch");
            let last = self.last.get_or_insert_with(Vec::new);
            last.clear();
            last.extend_from_slice(key);
        }
        match self.tally.write_sum(key) {
            true => self.sums.push((key.to_vec(), delta)),
            false => batch.merge_cf(counts_cf, key, delta.encode()),
        }
    }

    /// Writes the sums (only the thread applying this shard's batch writes counts,
    /// so nothing changes a key between this read and the commit). A stored value that does not
    /// decode fails the batch, as a read of it would.
    fn finish(self, store: &ShardStore, batch: &mut WriteBatch, counts_cf: &rocksdb::ColumnFamily) -> Result<()> {
        if self.sums.is_empty() {
            return Ok(());
        }
        // Each key once per batch (in key order), or a second sum would overwrite the first.
        debug_assert!(self.sums.windows(2).all(|pair| pair[0].0 < pair[1].0), "count keys repeat in a batch");
        let stored = store.get_counts(&self.sums.iter().map(|(key, _)| key).collect::<Vec<_>>())?;
        for ((key, delta), value) in self.sums.iter().zip(stored) {
            batch.put_cf(counts_cf, key, (value + *delta).encode());
        }
        Ok(())
    }
}

/// A decoded record waiting in a run: offset, record time, message.
type Decoded<'a> = (i64, i64, ShardMessageRef<'a>);

impl ShardStore {
    /// Applies `records` (in offset order) at wall-clock `now` (which decides the
    /// buckets still retained); the dedupe window runs on each record's own time.
    pub fn apply(&self, records: &[ShardRecord<'_>], now: i64, mark_rollups: bool) -> Result<ApplyReport> {
        let mut report = ApplyReport { records: records.len(), ..Default::default() };
        let mut progress = self.progress();
        // What packed records (format version 3) hold, each unpacked once it is
        // reached; the decoded run borrows its names from there.
        let unpacked: Vec<OnceCell<Vec<u8>>> = records.iter().map(|_| OnceCell::new()).collect();
        let mut run: Vec<Decoded<'_>> = Vec::new();
        // The input time of the newest record applied that held more than marks
        // (a mark's time is when it was routed, not an input's).
        let mut newest_input: Option<i64> = None;
        for (record, unpacked) in records.iter().zip(&unpacked) {
            if progress.next_offset.is_some_and(|next| record.offset < next) {
                report.stale_records += 1;
                continue;
            }
            if let Some(next) = progress.next_offset.filter(|next| record.offset > *next) {
                report.gap = Some((next, record.offset));
                break;
            }
            let payload = match tally_core::wire::packed::unpack(record.payload) {
                Ok(Cow::Borrowed(payload)) => payload,
                Ok(Cow::Owned(payload)) => unpacked.get_or_init(move || payload).as_slice(),
                Err(err) => {
                    report.undecodable = Some((record.offset, err.to_string()));
                    break;
                }
            };
            // A record's messages: one, or a bundle's sections (format 4), each applied
            // as a record of its own would be, with its own record time.
            let messages = match ShardMessageRef::decode_sections(payload, record.timestamp.unwrap_or(now)) {
                Ok(messages) => messages,
                Err(err) => {
                    report.undecodable = Some((record.offset, err.to_string()));
                    break;
                }
            };
            if messages.iter().any(|(_, message)| !matches!(message, ShardMessageRef::Marks { .. })) {
                newest_input = newest_input.max(record.timestamp.map(|at| at.min(now)));
            }
            for (record_time, message) in messages {
                let ShardMessageRef::DescChanges { source, entries } = message else {
                    run.push((record.offset, record_time, message));
                    continue;
                };
                // The run before is committed first, with the progress up to it: a
                // crash in between re-applies this record, never skips it.
                self.apply_counts(&run, &mut progress, now, mark_rollups, &mut report)?;
                run.clear();
                progress.next_offset = Some(record.offset + 1);
                self.apply_desc_changes(
                    (record.offset, payload),
                    source,
                    entries,
                    &mut progress,
                    now,
                    mark_rollups,
                    &mut report,
                )?;
            }
            progress.next_offset = Some(record.offset + 1);
        }
        // Also commits the progress past stale records.
        self.apply_counts(&run, &mut progress, now, mark_rollups, &mut report)?;
        // A producer's clock ahead of ours says nothing newer than now (above).
        self.freshness.applied(progress.next_offset.unwrap_or(0), newest_input);
        Ok(report)
    }

    /// Applies a run of increment and totals records in one write batch.
    fn apply_counts(
        &self,
        run: &[Decoded<'_>],
        progress: &mut Progress,
        now: i64,
        mark_rollups: bool,
        report: &mut ApplyReport,
    ) -> Result<()> {
        let descendants = self.views();
        let mut admissions = Admissions::new(self);
        let mut coalescer = Coalescer::new(&self.options.resolutions, now);
        if mark_rollups {
            coalescer = coalescer.noting_expired(crate::store::rollup_book::TOMBSTONE_WINDOW_MS);
        }
        let mut batch = WriteBatch::default();
        // Ids marked in this batch, with the record time of their marks.
        let mut ids_in_batch: FxHashMap<(&str, &str), i64> = FxHashMap::default();
        let mut key = Vec::with_capacity(128);
        let dedupe_cf = self.cf(CF_DEDUPE)?;
        let outbox_cf = self.cf(CF_OUTBOX)?;

        // Totals the record being applied sends to other shards, coalesced within the
        // record (over all of a bundle's sections, which share its offset).
        let mut remote: BTreeMap<u32, Coalescer<'_>> = BTreeMap::new();
        for (at, (offset, record_time, message)) in run.iter().enumerate() {
            match message {
                ShardMessageRef::Increments { source, entries } => {
                    for (stamp, increment) in entries {
                        if !progress.advance(*source, *stamp) {
                            report.redelivered += 1;
                            continue;
                        }
                        if let Some(id) = increment.id {
                            key.clear();
                            encode_dedupe_key(&mut key, increment.entity, id);
                            // The mark this batch wrote, else the stored one: as if
                            // each record had been a batch of its own (a replay cuts
                            // batches elsewhere).
                            let repeats = match ids_in_batch.get(&(increment.entity, id)) {
                                Some(&marked) => self.repeats_in_batch(marked, *record_time),
                                None => self.seen_recently(&key, *record_time)?,
                            };
                            if repeats {
                                report.duplicate_ids += 1;
                                continue;
                            }
                            ids_in_batch.insert((increment.entity, id), *record_time);
                            batch.put_cf(dedupe_cf, &key, DedupeWindow::mark(*record_time, *source));
                        }
                        report.increments += 1;
                        let (entity, ts, delta) = (increment.entity, increment.ts, increment.delta);
                        // A segmented increment counts under its metric and under its
                        // combination (or the overflow, past the cap).
                        let metrics = match Combination::of(increment.metric) {
                            None => [Some(increment.metric), None],
                            Some(combination) => {
                                let origin = Origin { offset: *offset, source: *source, stamp: *stamp, increment };
                                let counted = admissions.admit(&mut batch, entity, combination, origin)?;
                                [Some(combination.metric), Some(counted)]
                            }
                        };
                        for metric in metrics.into_iter().flatten() {
                            coalescer.add(entity, metric, ts, Counts::increment(delta));
                            for d in descendants.map.get(entity).into_iter().flatten() {
                                let counts = Counts::descendant(delta.into());
                                match shard_of(d, self.options.shards) {
                                    target if target == self.shard => coalescer.add(d, metric, ts, counts),
                                    target => remote
                                        .entry(target)
                                        .or_insert_with(|| Coalescer::new(&self.options.resolutions, now))
                                        .add(d, metric, ts, counts),
                                }
                            }
                        }
                    }
                }
                ShardMessageRef::Totals { source, entries } => {
                    for (stamp, delta) in entries {
                        if !progress.advance(*source, *stamp) {
                            report.redelivered += 1;
                            continue;
                        }
                        report.totals_received += 1;
                        let counts = Counts::descendant(delta.delta);
                        coalescer.add_bucket(delta.entity, delta.metric, delta.width_ms, delta.bucket, counts);
                    }
                }
                // How far the router has routed: what write tokens wait for.
                ShardMessageRef::Marks { marks } => {
                    for (source, stamp) in marks {
                        progress.advance(*source, *stamp);
                    }
                }
                ShardMessageRef::DescChanges { .. } => {}
            }
            // A record's totals go out once all of its sections are in.
            if run.get(at + 1).is_some_and(|(next, _, _)| next == offset) {
                continue;
            }
            for (target, totals) in std::mem::take(&mut remote).iter_mut() {
                let mut entries = Vec::with_capacity(totals.keys());
                totals.for_each(|entity, metric, width_ms, bucket, counts| {
                    entries.push(TotalDelta {
                        entity: entity.into(),
                        metric: metric.into(),
                        width_ms,
                        bucket,
                        delta: counts.total,
                    });
                });
                let entries = stamp_totals(*offset, entries, &self.options.resolutions);
                self.put_outbox(&mut batch, outbox_cf, *offset, *target, entries, report)?;
            }
        }

        let (counts_cf, rollups_cf) = (self.cf(CF_COUNTS)?, self.cf(CF_ROLLUPS)?);
        report.keys += coalescer.keys();
        let mut marking = self.marking(mark_rollups)?;
        // The direct deltas of cached origins, added to their copies once committed.
        let mut cache = self.direct_cache();
        let caching = !cache.is_empty();
        let mut cached_deltas: Vec<(&str, &str, i64, i64, Count)> = Vec::new();
        let mut last_entity: Option<(&str, bool)> = None;
        let mut writes = self.count_writes()?;
        coalescer.for_each(|entity, metric, width_ms, bucket, counts| {
            key.clear();
            encode_count_key(&mut key, entity, metric, width_ms, bucket);
            writes.add(&mut batch, counts_cf, &key, counts);
            marking.mark(&mut batch, rollups_cf, metric, &key);
            if caching && counts.direct != 0 {
                // Deltas come entity by entity: each is looked up once.
                let cached = match last_entity {
                    Some((last, cached)) if last == entity => cached,
                    _ => cache.contains(entity),
                };
                last_entity = Some((entity, cached));
                if cached {
                    cached_deltas.push((entity, metric, width_ms, bucket, counts.direct));
                }
            }
        });
        writes.finish(self, &mut batch, counts_cf)?;
        // Buckets that expired lately are marked, with no counts: their rollups go
        // as tombstones (an earlier owner may have published values).
        coalescer.for_each_expired(|entity, metric, width_ms, bucket| {
            key.clear();
            encode_count_key(&mut key, entity, metric, width_ms, bucket);
            marking.mark(&mut batch, rollups_cf, metric, &key);
        });
        self.commit(batch, progress.clone())?;
        for (entity, metric, width_ms, bucket, delta) in cached_deltas {
            cache.add(entity, metric, width_ms, bucket, delta);
        }
        drop(cache);
        report.segment_overflows += admissions.overflowed;
        admissions.committed();
        drop(descendants);
        marking.committed(report);
        // Only producers' increments move their sources' stream time.
        for (_, record_time, message) in run {
            if let ShardMessageRef::Increments { source, .. } = message {
                self.advance_stream_time(*source, *record_time);
            }
        }
        Ok(())
    }

    /// Applies one record of descendant changes in its own write batch.
    #[allow(clippy::too_many_arguments)]
    fn apply_desc_changes(
        &self,
        (offset, payload): (i64, &[u8]),
        source: Source,
        entries: Vec<(Stamp, DescChangeRef<'_>)>,
        progress: &mut Progress,
        now: i64,
        mark_rollups: bool,
        report: &mut ApplyReport,
    ) -> Result<()> {
        let mut batch = WriteBatch::default();
        let (counts_cf, outbox_cf) = (self.cf(CF_COUNTS)?, self.cf(CF_OUTBOX)?);
        let view_cfs = (self.cf(CF_DESC)?, self.cf(CF_DESC_LOG)?);
        let rollups_cf = self.cf(CF_ROLLUPS)?;
        // Totals here summed by (descendant, metric number, width, bucket): keys are
        // encoded once each, when written.
        let mut local: FxHashMap<(&str, u32, i64, i64), Count> = FxHashMap::default();
        let mut remote: BTreeMap<u32, Vec<TotalDelta>> = BTreeMap::new();
        let mut descendants = self.views();
        // One iterator for every origin of the record whose counts are not in memory
        // (a seek each), not one each: what the record changes is written only when
        // it commits.
        let mut counts = self.store.db().raw_iterator_cf(counts_cf);
        // Stamps are checked in their order; the changes that pass are then handled
        // in origin order (stable: one origin's changes keep theirs), so the seeks move
        // forward. Each change's deltas come from the counts as committed before the
        // record, so the order changes no sum.
        let mut accepted: Vec<(Stamp, DescChangeRef<'_>)> = Vec::with_capacity(entries.len());
        let all = entries.len();
        for (stamp, change) in entries {
            if progress.advance(source, stamp) {
                accepted.push((stamp, change));
            } else {
                report.redelivered += 1;
            }
        }
        accepted.sort_by(|(_, a), (_, b)| a.origin.cmp(b.origin));
        let mut scratch = Scratch::default();
        let mut cache = self.direct_cache();
        for (_, change) in &accepted {
            report.desc_changes += 1;
            self.origin_direct(&mut counts, &mut cache, change.origin, now, &mut scratch)?;
            // Deltas come descendant by descendant: its shard is looked up once.
            let mut last_target: Option<(&str, u32)> = None;
            for (d, (metric, width_ms, bucket), delta) in
                change_deltas((&change.added, &change.removed), &scratch.numbered)
            {
                let target = match last_target {
                    Some((last, target)) if last == d => target,
                    _ => shard_of(d, self.options.shards),
                };
                last_target = Some((d, target));
                if target == self.shard {
                    *local.entry((d, metric, width_ms, bucket)).or_insert(0) += delta;
                } else {
                    remote.entry(target).or_default().push(TotalDelta {
                        entity: d.to_string(),
                        metric: scratch.metric_names[metric as usize].clone(),
                        width_ms,
                        bucket,
                        delta,
                    });
                }
            }
            descendants.change(change);
        }
        drop((cache, counts));
        report.keys += local.len();
        let mut sums: Vec<(Vec<u8>, u32, Count)> = local
            .into_iter()
            .map(|((d, metric, width_ms, bucket), delta)| {
                let mut key = Vec::new();
                encode_count_key(&mut key, d, &scratch.metric_names[metric as usize], width_ms, bucket);
                (key, metric, delta)
            })
            .collect();
        sums.sort_unstable();
        // The record is logged as it came, or with only the changes accepted.
        let reencoded = match accepted.len() == all {
            true => None,
            false => {
                let entries = accepted.into_iter().map(|(stamp, change)| (stamp, change.into_owned())).collect();
                Some(ShardMessage::DescChanges { source, entries }.encode()?)
            }
        };
        let logged = reencoded.as_deref().unwrap_or(payload);
        let persisted = descendants.persist(&mut batch, view_cfs, offset, logged, self.options.view_log_bytes)?;
        let mut marking = self.marking(mark_rollups)?;
        let mut writes = self.count_writes()?;
        for (key, metric, delta) in sums {
            writes.add(&mut batch, counts_cf, &key, Counts::descendant(delta));
            marking.mark(&mut batch, rollups_cf, &scratch.metric_names[metric as usize], &key);
        }
        writes.finish(self, &mut batch, counts_cf)?;
        for (target, deltas) in remote {
            let entries = stamp_totals(offset, deltas, &self.options.resolutions);
            self.put_outbox(&mut batch, outbox_cf, offset, target, entries, report)?;
        }
        self.commit(batch, progress.clone())?;
        descendants.committed(persisted);
        drop(descendants);
        marking.committed(report);
        Ok(())
    }

    /// Whether a bucket is still retained at `now` (all-time always is).
    fn retained(&self, width_ms: i64, bucket: i64, now: i64) -> bool {
        width_ms == ALL_TIME_WIDTH
            || self.options.resolutions.by_width(width_ms).is_some_and(|r| r.retains(bucket, now))
    }

    /// The origin's retained direct buckets, into `scratch.numbered` (metrics by
    /// their numbers in `scratch.metric_names`): from the cache when it holds the
    /// origin; else read from the store ([`ShardStore::retained_direct`]) and cached
    /// ([`crate::direct`]). Either way in key order.
    fn origin_direct(
        &self,
        counts: &mut rocksdb::DBRawIteratorWithThreadMode<'_, rocksdb::DB>,
        cache: &mut DirectCache,
        origin: &str,
        now: i64,
        scratch: &mut Scratch,
    ) -> Result<()> {
        scratch.numbered.clear();
        if let Some(cached) = cache.get(origin, |width_ms, bucket| self.retained(width_ms, bucket, now)) {
            for metric in cached {
                let number = metric_number(&mut scratch.metric_names, &metric.metric);
                let buckets =
                    metric.buckets.iter().map(|&(width_ms, bucket, value)| ((number, width_ms, bucket), value));
                scratch.numbered.extend(buckets);
            }
            return Ok(());
        }
        self.retained_direct(counts, origin, now, scratch)?;
        // A metric's buckets come together: its name is looked up once.
        let mut last_metric: Option<((u32, u32), u32)> = None;
        for &((range, width_ms, bucket), value) in &scratch.direct {
            let number = match last_metric {
                Some((last, number)) if last == range => number,
                _ => metric_number(&mut scratch.metric_names, &scratch.metrics[range.0 as usize..range.1 as usize]),
            };
            last_metric = Some((range, number));
            scratch.numbered.push(((number, width_ms, bucket), value));
        }
        if cache.caches() {
            let mut direct: EntityDirect = Vec::new();
            for &(((start, end), width_ms, bucket), value) in &scratch.direct {
                let metric = &scratch.metrics[start as usize..end as usize];
                match direct.last_mut() {
                    Some(last) if last.metric == metric => last.buckets.push((width_ms, bucket, value)),
                    _ => direct
                        .push(MetricBuckets { metric: metric.to_string(), buckets: vec![(width_ms, bucket, value)] }),
                }
            }
            cache.insert(origin, direct);
        }
        Ok(())
    }

    /// The origin's direct value in every bucket still retained at `now`, into
    /// `scratch.direct` (its metrics' names into `scratch.metrics`), read from the
    /// store.
    fn retained_direct(
        &self,
        counts: &mut rocksdb::DBRawIteratorWithThreadMode<'_, rocksdb::DB>,
        origin: &str,
        now: i64,
        scratch: &mut Scratch,
    ) -> Result<()> {
        scratch.prefix.clear();
        encode_entity_prefix(&mut scratch.prefix, origin);
        scratch.direct.clear();
        scratch.metrics.clear();
        counts.seek(&scratch.prefix);
        while let (Some(key), Some(value)) = (counts.key(), counts.value()) {
            if !key.starts_with(&scratch.prefix) {
                break;
            }
            let count_key = parse_count_key(key)?;
            let retained = self.retained(count_key.width_ms, count_key.bucket, now);
            let value = Counts::decode(value)?.direct;
            if retained && value != 0 {
                // An origin's keys come metric by metric: a name is stored once.
                let metric = match scratch.direct.last() {
                    Some((((start, end), _, _), _))
                        if &scratch.metrics[*start as usize..*end as usize] == count_key.metric =>
                    {
                        (*start, *end)
                    }
                    _ => {
                        let start = scratch.metrics.len() as u32;
                        scratch.metrics.push_str(count_key.metric);
                        (start, scratch.metrics.len() as u32)
                    }
                };
                scratch.direct.push(((metric, count_key.width_ms, count_key.bucket), value));
            }
            counts.next();
        }
        counts.status()?;
        Ok(())
    }

    fn put_outbox(
        &self,
        batch: &mut WriteBatch,
        outbox_cf: &rocksdb::ColumnFamily,
        offset: i64,
        target: u32,
        entries: Vec<(Stamp, TotalDelta)>,
        report: &mut ApplyReport,
    ) -> Result<()> {
        let source = Source { stream: Source::SHARD, partition: self.shard };
        // Split to fit the broker's record limit; chunks keep the stamps' order.
        for (chunk, run) in
            split_by_size(&entries, self.options.record_budget, |(_, d)| d.size_bound()).into_iter().enumerate()
        {
            let payload = ShardMessage::Totals { source, entries: run.to_vec() }.encode()?;
            batch.put_cf(outbox_cf, outbox_key(offset, target, chunk as u32), payload);
            report.outbox_messages += 1;
        }
        Ok(())
    }

    /// The count writes of one write batch, with the memtable's switch (if any) told
    /// to the operand tally.
    fn count_writes(&self) -> Result<CountWrites<'_>> {
        let mut tally = self.operand_tally();
        // Unreadable, the counts carry on (a key is then summed sooner, never wrong).
        let entries = self.store.db().property_int_value_cf(self.cf(CF_COUNTS)?, NUM_ENTRIES_ACTIVE_MEM_TABLE);
        if let Ok(Some(entries)) = entries {
            tally.memtable_holds(entries);
        }
        tally.begin_batch();
        Ok(CountWrites {
            tally,
            sums: Vec::new(),
            #[cfg(debug_assertions)]
            last: None,
        })
    }

    /// The marks of one write batch; `rollups` off: none.
    fn marking(&self, rollups: bool) -> Result<Marking<'_>> {
        Ok(Marking { marked: if rollups { Some(self.marked()) } else { None }, written: Vec::new() })
    }
}

#[cfg(test)]
mod tests {
    use tally_core::graph::DescChange;
    use tally_core::keys::ALL_TIME_WIDTH;
    use tally_core::wire::{Increment, Positions};

    use tally_shared::outbox::OutboxEntry;

    use super::*;
    use crate::store::StoreOptions;

    const NOW: i64 = 1_763_780_000_000;

    fn options() -> StoreOptions {
        StoreOptions::default()
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

    fn all_time(store: &ShardStore, entity: &str) -> Count {
        let mut key = Vec::new();
        encode_count_key(&mut key, entity, "views", ALL_TIME_WIDTH, 0);
        store.get_counts(&[key]).unwrap()[0].direct
    }

    #[test]
    fn redelivered_records_and_entries_count_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(10, 0, "a", 1, None), (10, 1, "a", 2, None), (11, 0, "b", 5, None)]);
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first, timestamp: None }], NOW, false).unwrap();
        assert_eq!(report.increments, 3);
        // Kafka redelivers offset 0: skipped by offset.
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first, timestamp: None }], NOW, false).unwrap();
        assert_eq!(report.stale_records, 1);
        // The ingester re-sent the same entries plus a new one at a new offset.
        let again = message(0, &[(10, 1, "a", 2, None), (11, 0, "b", 5, None), (12, 0, "a", 100, None)]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &again, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.redelivered, report.increments), (2, 1));
        assert_eq!(all_time(&store, "a"), 103);
        assert_eq!(all_time(&store, "b"), 5);
        // Another source's stamps are independent.
        let other = message(1, &[(10, 0, "a", 1000, None)]);
        store.apply(&[ShardRecord { offset: 2, payload: &other, timestamp: None }], NOW, false).unwrap();
        assert_eq!(all_time(&store, "a"), 1103);
    }

    #[test]
    fn first_entry_of_a_new_source_counts() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(0, 0, "a", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (1, 0));
        let same = message(0, &[(0, 0, "a", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &same, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (0, 1));
    }

    #[test]
    fn ids_deduplicate_within_and_across_batches_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = ShardStore::open(0, dir.path(), options()).unwrap();
            let payload =
                message(0, &[(1, 0, "a", 1, Some("x")), (2, 0, "a", 1, Some("x")), (3, 0, "b", 1, Some("x"))]);
            let report =
                store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, false).unwrap();
            assert_eq!((report.increments, report.duplicate_ids), (2, 1));
        }
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let payload = message(0, &[(4, 0, "a", 1, Some("x")), (5, 0, "a", 1, Some("y"))]);
        let report = store.apply(&[ShardRecord { offset: 1, payload: &payload, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.increments, report.duplicate_ids), (1, 1));
        // Past the window the id counts again.
        let payload = message(0, &[(6, 0, "a", 1, Some("x"))]);
        let report = store
            .apply(&[ShardRecord { offset: 2, payload: &payload, timestamp: None }], NOW + 86_400_000, false)
            .unwrap();
        assert_eq!(report.increments, 1);
        assert_eq!(all_time(&store, "a"), 3);
    }

    /// An id reused past the window counts again, and its repeats within the new
    /// mark's window do not, however the records fall into batches (a replay after
    /// a crash cuts them elsewhere).
    #[test]
    fn an_id_counts_by_the_window_in_one_batch_as_across_batches() {
        const WINDOW: i64 = 86_400_000;
        let payloads: Vec<Vec<u8>> = (1..=4).map(|offset| message(0, &[(offset, 0, "a", 1, Some("x"))])).collect();
        let times = [NOW, NOW + WINDOW - 1, NOW + WINDOW, NOW + WINDOW + 5];
        let records: Vec<ShardRecord<'_>> = payloads
            .iter()
            .zip(times)
            .enumerate()
            .map(|(offset, (payload, time))| ShardRecord { offset: offset as i64, payload, timestamp: Some(time) })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let one_batch = ShardStore::open(0, &dir.path().join("one"), options()).unwrap();
        let report = one_batch.apply(&records, NOW + WINDOW, false).unwrap();
        let batches = ShardStore::open(0, &dir.path().join("each"), options()).unwrap();
        let mut each = (0, 0);
        for record in &records {
            let report = batches.apply(std::slice::from_ref(record), NOW + WINDOW, false).unwrap();
            each = (each.0 + report.increments, each.1 + report.duplicate_ids);
        }
        assert_eq!(each, (2, 2), "the first and the one a window later count");
        assert_eq!((report.increments, report.duplicate_ids), each);
        assert_eq!((all_time(&one_batch, "a"), all_time(&batches, "a")), (2, 2));
    }

    /// The counts of `entity`'s all-time key and how many merge operands a read
    /// collected to sum them (RocksDB counts them for iterators, not point reads).
    fn counts_and_operands(store: &ShardStore, entity: &str) -> (Counts, u64) {
        use rocksdb::perf::{set_perf_stats, PerfContext, PerfMetric, PerfStatsLevel};
        let mut key = Vec::new();
        encode_count_key(&mut key, entity, "views", ALL_TIME_WIDTH, 0);
        set_perf_stats(PerfStatsLevel::EnableCount);
        let mut context = PerfContext::default();
        context.reset();
        let mut iterator = store.store.db().raw_iterator_cf(store.cf(CF_COUNTS).unwrap());
        iterator.seek(&key);
        assert_eq!(iterator.key(), Some(key.as_slice()));
        let read = Counts::decode(iterator.value().unwrap()).unwrap();
        (read, context.metric(PerfMetric::InternalMergeCount))
    }

    #[test]
    fn a_popular_key_stacks_a_bounded_number_of_operands_and_sums_exactly() {
        use crate::operands::MAX_OPERANDS;
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let (mut hot, mut cold) = (0, 0);
        let mut operands_read = Vec::new();
        // Batch after batch (several increments of the hot key in each, coalesced to
        // one write; the cold key now and then), every sum stays exact and no read
        // collects more than the bound.
        let rounds = 5 * (i64::from(MAX_OPERANDS) + 1);
        for round in 0..rounds {
            let mut entries = vec![(round, 0, "hot", round + 1, None), (round, 1, "hot", -2, None)];
            hot += round - 1;
            if round % 4 == 0 {
                entries.push((round, 2, "cold", 3 * round, None));
                cold += 3 * round;
            }
            let payload = message(0, &entries);
            store.apply(&[ShardRecord { offset: round, payload: &payload, timestamp: None }], NOW, true).unwrap();
            let (read, operands) = counts_and_operands(&store, "hot");
            assert_eq!(read, Counts::increment(hot), "after round {round}");
            assert_eq!(counts(&store, "cold"), Counts::increment(cold), "after round {round}");
            operands_read.push(operands);
        }
        // The operands stack up to the bound, then every write sums them (RocksDB
        // counts the operands a read merges after the newest one).
        let bound = u64::from(MAX_OPERANDS);
        let want: Vec<u64> = (0..rounds as u64).map(|round| if round < bound { round } else { 0 }).collect();
        assert_eq!(operands_read, want);
        drop(store);
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        assert_eq!(counts(&store, "hot"), Counts::increment(hot), "reopened");
        assert_eq!(counts(&store, "cold"), Counts::increment(cold), "reopened");
    }

    #[test]
    fn operands_count_again_from_zero_in_a_new_memtable() {
        use crate::operands::MAX_OPERANDS;
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let mut offset = 0;
        let mut write_hot = |store: &ShardStore| {
            let payload = message(0, &[(offset, 0, "hot", 1, None)]);
            store.apply(&[ShardRecord { offset, payload: &payload, timestamp: None }], NOW, false).unwrap();
            offset += 1;
        };
        for _ in 0..5 {
            write_hot(&store);
        }
        store.store.db().flush_cf(store.cf(CF_COUNTS).unwrap()).unwrap();
        // The flush summed the five into one operand in a file; the new memtable then
        // takes the bound's worth (counted from zero: a count carried over from the
        // old memtable would have summed the key three writes ago).
        for _ in 0..MAX_OPERANDS {
            write_hot(&store);
        }
        let stacked = 5 + i64::from(MAX_OPERANDS);
        let operands_after_the_newest = u64::from(MAX_OPERANDS);
        assert_eq!(counts_and_operands(&store, "hot"), (Counts::increment(stacked), operands_after_the_newest));
        write_hot(&store);
        assert_eq!(counts_and_operands(&store, "hot"), (Counts::increment(stacked + 1), 0));
    }

    #[test]
    fn a_corrupt_count_fails_the_batch_that_is_to_write_its_sum() {
        use crate::operands::MAX_OPERANDS;
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let mut key = Vec::new();
        encode_count_key(&mut key, "broken", "views", ALL_TIME_WIDTH, 0);
        store.store.db().put_cf(store.cf(CF_COUNTS).unwrap(), &key, b"\xffnot counts").unwrap();
        let mut failed = None;
        for round in 0..=i64::from(MAX_OPERANDS) {
            let payload = message(0, &[(round, 0, "broken", 1, None)]);
            match store.apply(&[ShardRecord { offset: round, payload: &payload, timestamp: None }], NOW, false) {
                Ok(_) => assert!(store.get_counts(&[&key]).is_err(), "round {round}: the read fails"),
                Err(err) => {
                    failed = Some((round, err.to_string()));
                    break;
                }
            }
        }
        let (round, error) = failed.expect("the batch that sums the key fails");
        assert_eq!(round, i64::from(MAX_OPERANDS), "{error}");
        assert!(error.to_lowercase().contains("corrupt"), "{error}");
        assert_eq!(store.progress().next_offset, Some(round), "nothing of the failed batch is committed");
        // Retried (the shard taken again), the batch fails again.
        let payload = message(0, &[(round, 0, "broken", 1, None)]);
        let again = store.apply(&[ShardRecord { offset: round, payload: &payload, timestamp: None }], NOW, false);
        assert!(again.is_err(), "{again:?}");
        assert_eq!(store.progress().next_offset, Some(round));
    }

    fn counts(store: &ShardStore, entity: &str) -> Counts {
        let mut key = Vec::new();
        encode_count_key(&mut key, entity, "views", ALL_TIME_WIDTH, 0);
        store.get_counts(&[key]).unwrap()[0]
    }

    fn desc_change(seq: i64, origin: &str, added: &[&str], removed: &[&str]) -> Vec<u8> {
        let change = DescChange {
            origin: origin.into(),
            added: added.iter().map(|s| s.to_string()).collect(),
            removed: removed.iter().map(|s| s.to_string()).collect(),
        };
        let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
        ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: seq, index: 0 }, change)] }.encode().unwrap()
    }

    #[test]
    fn descendant_changes_move_direct_counts_and_route_increments() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let before = message(0, &[(1, 0, "a", 5, None), (1, 1, "b", 1, None)]);
        let gain = desc_change(0, "a", &["b", "c"], &[]);
        let during = message(0, &[(2, 0, "a", 2, None)]);
        let lose = desc_change(1, "a", &[], &["c"]);
        let records = [
            ShardRecord { offset: 0, payload: &before, timestamp: None },
            ShardRecord { offset: 1, payload: &gain, timestamp: None },
            ShardRecord { offset: 2, payload: &during, timestamp: None },
            ShardRecord { offset: 3, payload: &lose, timestamp: None },
        ];
        let report = store.apply(&records, NOW, false).unwrap();
        assert_eq!((report.increments, report.desc_changes), (3, 2));
        assert_eq!(counts(&store, "a"), Counts { direct: 7, total: 7 });
        assert_eq!(counts(&store, "b"), Counts { direct: 1, total: 8 });
        assert_eq!(counts(&store, "c"), Counts { direct: 0, total: 0 });
        assert_eq!(store.descendants_of("a"), vec!["b".to_string()]);
        // A redelivered change is dropped; the view survives a restart.
        let report = store.apply(&[ShardRecord { offset: 4, payload: &gain, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.desc_changes, report.redelivered), (0, 1));
        drop(store);
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        assert_eq!(store.descendants_of("a"), vec!["b".to_string()]);
    }

    #[test]
    fn totals_for_other_shards_go_through_the_outbox_exactly_once() {
        let two = StoreOptions { shards: 2, ..options() };
        let (remote_entity, local_shard) = ("far", 1 - shard_of("far", 2));
        let dir = tempfile::tempdir().unwrap();
        let sender = ShardStore::open(local_shard, &dir.path().join("s"), two.clone()).unwrap();
        let receiver = ShardStore::open(1 - local_shard, &dir.path().join("r"), two).unwrap();
        let inc = message(0, &[(1, 0, "o", 4, None)]);
        let gain = desc_change(0, "o", &[remote_entity], &[]);
        let more = message(0, &[(2, 0, "o", 1, None)]);
        let records = [
            ShardRecord { offset: 0, payload: &inc, timestamp: None },
            ShardRecord { offset: 1, payload: &gain, timestamp: None },
            ShardRecord { offset: 2, payload: &more, timestamp: None },
        ];
        sender.apply(&records, NOW, false).unwrap();
        let outbox = sender.outbox().unwrap();
        assert_eq!(outbox.len(), 2, "one message per source record with remote totals");
        assert!(outbox.iter().all(|e| e.partition == 1 - local_shard));
        // Delivered twice (a relay that crashed before deleting): counted once.
        let delivered: Vec<ShardRecord<'_>> = outbox
            .iter()
            .chain(&outbox)
            .enumerate()
            .map(|(i, e)| ShardRecord { offset: i as i64, payload: &e.payload, timestamp: None })
            .collect();
        let report = receiver.apply(&delivered, NOW, false).unwrap();
        assert_eq!(report.redelivered, report.totals_received);
        assert_eq!(counts(&receiver, remote_entity), Counts { direct: 0, total: 5 });
        sender.delete_outbox(&outbox).unwrap();
        assert!(sender.outbox().unwrap().is_empty());
        // Replaying the sender's log from scratch produces the same stamps: dropped.
        let rebuilt =
            ShardStore::open(local_shard, &dir.path().join("s2"), StoreOptions { shards: 2, ..options() }).unwrap();
        rebuilt.apply(&records, NOW, false).unwrap();
        let replayed = rebuilt.outbox().unwrap();
        let replayed: Vec<ShardRecord<'_>> = replayed
            .iter()
            .enumerate()
            .map(|(i, e)| ShardRecord { offset: 10 + i as i64, payload: &e.payload, timestamp: None })
            .collect();
        receiver.apply(&replayed, NOW, false).unwrap();
        assert_eq!(counts(&receiver, remote_entity), Counts { direct: 0, total: 5 });
    }

    /// The router's marks move a source's high water past records that sent this
    /// shard nothing; positions say what was applied, and relayed once the outbox
    /// holds nothing of it.
    #[test]
    fn marks_and_relays_show_in_the_positions() {
        let two = StoreOptions { shards: 2, ..options() };
        let (remote_entity, local_shard) = ("far", 1 - shard_of("far", 2));
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(local_shard, dir.path(), two).unwrap();
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let other = Source { stream: Source::INCREMENTS, partition: 1 };
        let gain = desc_change(0, "o", &[remote_entity], &[]);
        let inc = message(0, &[(4, 0, "o", 4, None)]);
        let marks = ShardMessage::Marks { marks: vec![(source, Stamp::through(9)), (other, Stamp::through(2))] }
            .encode()
            .unwrap();
        let stale_mark = ShardMessage::Marks { marks: vec![(source, Stamp::through(6))] }.encode().unwrap();
        let records = [
            ShardRecord { offset: 0, payload: &gain, timestamp: None },
            ShardRecord { offset: 1, payload: &inc, timestamp: None },
        ];
        store.apply(&records, NOW, false).unwrap();
        let at = store.positions(&[source, other]).unwrap();
        assert_eq!(
            at,
            Positions { applied: 2, relayed: 0, high_water: vec![Some(Stamp { offset: 4, index: 0 }), None] }
        );
        let marked = [
            ShardRecord { offset: 2, payload: &marks, timestamp: Some(NOW - 5) },
            ShardRecord { offset: 3, payload: &stale_mark, timestamp: Some(NOW - 5) },
        ];
        store.apply(&marked, NOW, false).unwrap();
        // A mark's time is its routing's, not an input's: it says nothing of the lag.
        assert_eq!(store.freshness.as_of(NOW).lag_ms, None);
        let want = vec![Some(Stamp::through(9)), Some(Stamp::through(2))];
        assert_eq!(
            store.positions(&[source, other]).unwrap(),
            Positions { applied: 4, relayed: 0, high_water: want.clone() }
        );
        // A replayed increment below the mark is dropped; the marks survive a restart.
        let replayed = message(0, &[(5, 0, "o", 1, None)]);
        let report =
            store.apply(&[ShardRecord { offset: 4, payload: &replayed, timestamp: None }], NOW, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (0, 1));
        store.delete_outbox(&store.outbox().unwrap()).unwrap();
        assert_eq!(
            store.positions(&[source, other]).unwrap(),
            Positions { applied: 5, relayed: 5, high_water: want.clone() }
        );
        drop(store);
        let store = ShardStore::open(local_shard, dir.path(), StoreOptions { shards: 2, ..options() }).unwrap();
        assert_eq!(store.positions(&[source, other]).unwrap().high_water, want);
    }

    /// A shard moves: its log is applied again minutes later (a restore after the
    /// snapshot) while the receiver had only the first of the first run's messages
    /// for a record of changes. Minute buckets expired in between, so the replay
    /// sends fewer totals; the receiver still ends with every retained bucket once.
    #[test]
    fn a_replay_minutes_later_sends_a_receiver_what_it_lacks_once() {
        use tally_core::counting::Coalescer;
        const MINUTE: i64 = 60_000;
        let (later, six_hours) = (NOW + 5 * MINUTE, 6 * 60 * MINUTE);
        let options = StoreOptions { shards: 2, record_budget: 600, ..options() };
        let sender_shard = shard_of("o", 2);
        let far: Vec<String> =
            (0..).map(|i| format!("far{i}")).filter(|e| shard_of(e, 2) != sender_shard).take(2).collect();
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str, shard: u32| ShardStore::open(shard, &dir.path().join(name), options.clone()).unwrap();
        // Minute buckets from past their retention to ones that expire in the five
        // minutes, and one now.
        let increments: Vec<Increment> = (0..20i64)
            .map(|k| NOW - six_hours + (k - 10) * MINUTE)
            .chain([NOW])
            .enumerate()
            .map(|(k, ts)| Increment { entity: "o".into(), metric: "views".into(), delta: k as i64 + 1, ts, id: None })
            .collect();
        let entries =
            increments.iter().cloned().enumerate().map(|(k, i)| (Stamp { offset: 1, index: k as u32 }, i)).collect();
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let counted = ShardMessage::Increments { source, entries }.encode().unwrap();
        let far_names: Vec<&str> = far.iter().map(String::as_str).collect();
        let gain = desc_change(0, "o", &far_names, &[]);
        let records = [
            ShardRecord { offset: 0, payload: &counted, timestamp: None },
            ShardRecord { offset: 1, payload: &gain, timestamp: None },
        ];
        let deliver = |receiver: &ShardStore, outbox: &[OutboxEntry], first_offset: i64| {
            let delivered: Vec<ShardRecord<'_>> = outbox
                .iter()
                .enumerate()
                .map(|(i, e)| ShardRecord { offset: first_offset + i as i64, payload: &e.payload, timestamp: None })
                .collect();
            receiver.apply(&delivered, later, false).unwrap()
        };
        let first = open("first", sender_shard);
        first.apply(&records, NOW, false).unwrap();
        let sent = first.outbox().unwrap();
        assert!(sent.len() >= 3, "the record's totals take several messages: {}", sent.len());
        let receiver = open("receiver", 1 - sender_shard);
        deliver(&receiver, &sent[..1], 0);
        let replay = open("replay", sender_shard);
        replay.apply(&records, later, false).unwrap();
        let resent = replay.outbox().unwrap();
        let report = deliver(&receiver, &resent, 1);
        assert!(report.redelivered > 0 && report.totals_received > 0, "{report:?}");
        // Every bucket retained now, all-time included, holds its whole sum in each
        // far descendant's total.
        let resolutions = &options.resolutions;
        let mut expected = Coalescer::new(resolutions, later);
        for i in &increments {
            expected.add(&i.entity, &i.metric, i.ts, Counts::increment(i.delta));
        }
        let mut want = Vec::new();
        expected.for_each(|_, _, width, bucket, counts| want.push((width, bucket, counts.direct)));
        // Five of the old minutes are left, the five after them expired since the first run.
        assert_eq!(want.iter().filter(|(width, ..)| *width == MINUTE).count(), 6, "{want:?}");
        for d in &far {
            let keys: Vec<Vec<u8>> = want
                .iter()
                .map(|(width, bucket, _)| {
                    let mut key = Vec::new();
                    encode_count_key(&mut key, d, "views", *width, *bucket);
                    key
                })
                .collect();
            let got: Vec<(i64, i64, Count)> =
                receiver.get_counts(&keys).unwrap().iter().zip(&want).map(|(c, (w, b, _))| (*w, *b, c.total)).collect();
            assert_eq!(got, want, "{d}");
        }
    }

    /// One record of changes for two origins with two metrics, a bucket past its
    /// retention, a local and a remote descendant: every retained bucket of every
    /// metric moves, each origin's into its own descendants only.
    #[test]
    fn a_record_of_changes_moves_every_metric_and_retained_bucket_of_each_origin() {
        use tally_core::time::{bucket_start, Resolutions};
        const MINUTE: i64 = 60_000;
        const HOUR: i64 = 3_600_000;
        const DAY: i64 = 86_400_000;
        let old = NOW - 10 * DAY;
        let two = StoreOptions { shards: 2, ..options() };
        let shard = shard_of("near", 2);
        let far = (0..).map(|i| format!("far{i}")).find(|e| shard_of(e, 2) != shard).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(shard, dir.path(), two).unwrap();
        let increment = |index: u32, entity: &str, metric: &str, delta: i64, ts: i64| {
            let increment = Increment { entity: entity.into(), metric: metric.into(), delta, ts, id: None };
            (Stamp { offset: 1, index }, increment)
        };
        let increments = ShardMessage::Increments {
            source: Source { stream: Source::INCREMENTS, partition: 0 },
            entries: vec![
                increment(0, "o1", "views", 3, NOW),
                increment(1, "o1", "views", 4, old),
                increment(2, "o1", "clicks", 5, NOW),
                increment(3, "o2", "views", 7, NOW),
            ],
        }
        .encode()
        .unwrap();
        let change = |origin: &str, added: Vec<String>| DescChange { origin: origin.into(), added, removed: vec![] };
        let changes = ShardMessage::DescChanges {
            source: Source { stream: Source::GRAPH_PROCESSOR, partition: 0 },
            entries: vec![
                (Stamp { offset: 0, index: 0 }, change("o2", vec!["near".into()])),
                (Stamp { offset: 0, index: 1 }, change("o1", vec!["near".into(), far.clone()])),
            ],
        }
        .encode()
        .unwrap();
        let records = [
            ShardRecord { offset: 0, payload: &increments, timestamp: None },
            ShardRecord { offset: 1, payload: &changes, timestamp: None },
        ];
        assert_eq!(store.apply(&records, NOW, false).unwrap().desc_changes, 2);
        // Every bucket of both metrics, at NOW and ten days before (its minute is past
        // the 6 h retention: nothing of it moves).
        let resolutions = Resolutions::default();
        assert_eq!(resolutions.iter().map(|r| r.width_ms).collect::<Vec<_>>(), vec![MINUTE, HOUR, DAY]);
        let mut keys = vec![("views", ALL_TIME_WIDTH, 0), ("clicks", ALL_TIME_WIDTH, 0)];
        for width in [MINUTE, HOUR, DAY] {
            for ts in [NOW, old] {
                keys.push(("views", width, bucket_start(ts, width)));
                keys.push(("clicks", width, bucket_start(ts, width)));
            }
        }
        let encoded: Vec<Vec<u8>> = keys
            .iter()
            .map(|&(metric, width, bucket)| {
                let mut key = Vec::new();
                encode_count_key(&mut key, "near", metric, width, bucket);
                key
            })
            .collect();
        let near: Vec<Count> = store.get_counts(&encoded).unwrap().iter().map(|c| c.total).collect();
        // views all, clicks all; then per width: views now, clicks now, views old, clicks old.
        assert_eq!(near, vec![14, 5, 10, 5, 0, 0, 10, 5, 4, 0, 10, 5, 4, 0]);
        // far lives on the other shard: o1's buckets only, through the outbox.
        let mut sent: Vec<(String, String, i64, i64, Count)> = Vec::new();
        for entry in store.outbox().unwrap() {
            assert_eq!(entry.partition, 1 - shard);
            let ShardMessage::Totals { entries, .. } = ShardMessage::decode(&entry.payload).unwrap() else {
                panic!("the outbox holds totals")
            };
            sent.extend(entries.into_iter().map(|(_, d)| (d.entity, d.metric, d.width_ms, d.bucket, d.delta)));
        }
        sent.sort();
        let mut expected: Vec<(String, String, i64, i64, Count)> = vec![
            (far.clone(), "views".into(), ALL_TIME_WIDTH, 0, 7),
            (far.clone(), "clicks".into(), ALL_TIME_WIDTH, 0, 5),
            (far.clone(), "views".into(), MINUTE, bucket_start(NOW, MINUTE), 3),
            (far.clone(), "clicks".into(), MINUTE, bucket_start(NOW, MINUTE), 5),
        ];
        for width in [HOUR, DAY] {
            expected.push((far.clone(), "views".into(), width, bucket_start(NOW, width), 3));
            expected.push((far.clone(), "views".into(), width, bucket_start(old, width), 4));
            expected.push((far.clone(), "clicks".into(), width, bucket_start(NOW, width), 5));
        }
        expected.sort();
        assert_eq!(sent, expected);
        assert_eq!(store.descendants_of("o1"), {
            let mut view = vec!["near".to_string(), far.clone()];
            view.sort();
            view
        });
    }

    #[test]
    fn a_garbage_record_stops_the_batch_after_committing_what_came_before() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let good = message(0, &[(1, 0, "a", 1, None)]);
        let later = message(0, &[(2, 0, "a", 1, None)]);
        let records = [
            ShardRecord { offset: 5, payload: &good, timestamp: None },
            ShardRecord { offset: 6, payload: b"garbage", timestamp: None },
            ShardRecord { offset: 7, payload: &later, timestamp: None },
        ];
        let report = store.apply(&records, NOW, true).unwrap();
        let (offset, reason) = report.undecodable.clone().unwrap();
        assert_eq!((offset, report.increments), (6, 1));
        assert!(reason.contains("not a tally record"), "{reason}");
        assert_eq!(store.progress().next_offset, Some(6), "stays at the failed record");
        assert_eq!(report.marked, 4);
        assert_eq!(store.pending_rollups(100).unwrap(), count_keys(&store, "a"), "marked for publishing");
    }

    /// Shard records of increments in format version 3 (what an ingester writes):
    /// each applies as its version 2 form; one that does not unpack stops the batch
    /// there, failing closed, after committing what came before.
    #[test]
    fn packed_records_apply_as_their_version_2_form_and_a_broken_one_stops_the_batch() {
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let record_in = |offset: i64, version: u8| {
            let entries: Vec<(Stamp, Increment)> = (0..400u32)
                .map(|index| {
                    let entity = format!("user-{}", index % 30);
                    let increment =
                        Increment { entity, metric: "views".into(), delta: i64::from(index % 5), ts: NOW, id: None };
                    (Stamp { offset, index }, increment)
                })
                .collect();
            ShardMessage::encode_increments(source, &entries, version).unwrap()
        };
        let (v2, v3) = ([record_in(1, 2), record_in(2, 2)], [record_in(1, 3), record_in(2, 3)]);
        assert_eq!((v2[0][1], v3[0][1]), (2, 3));
        let apply = |records: &[Vec<u8>]| {
            let dir = tempfile::tempdir().unwrap();
            let store = ShardStore::open(0, dir.path(), options()).unwrap();
            let records: Vec<ShardRecord<'_>> =
                (0..).zip(records).map(|(offset, payload)| ShardRecord { offset, payload, timestamp: None }).collect();
            let report = store.apply(&records, NOW, true).unwrap();
            let totals: Vec<Count> = (0..30).map(|user| all_time(&store, &format!("user-{user}"))).collect();
            (report.increments, report.marked, report.undecodable, store.progress().next_offset, totals)
        };
        let unpacked = apply(&v2);
        assert_eq!(unpacked.0, 800);
        assert_eq!(unpacked.4.iter().sum::<Count>(), 2 * (0..400).map(|i| i % 5).sum::<Count>());
        assert_eq!(apply(&v3), unpacked);

        let mut broken = v3.clone();
        let last = broken[1].len() - 1;
        broken[1][last] ^= 1;
        let (increments, _, undecodable, next_offset, _) = apply(&broken);
        let (offset, reason) = undecodable.unwrap();
        assert_eq!((offset, increments, next_offset), (1, 400, Some(1)), "stays at the broken record");
        assert!(reason.contains("shard record version 3"), "{reason}");

        // A record already applied is skipped by its offset before it is unpacked.
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = ShardRecord { offset: 0, payload: &v3[0], timestamp: None };
        store.apply(&[first], NOW, false).unwrap();
        let again = ShardRecord { offset: 0, payload: &broken[1], timestamp: None };
        let report = store.apply(&[again], NOW, false).unwrap();
        assert_eq!((report.stale_records, report.undecodable), (1, None));
    }

    /// A bundle (format 4) applies as its sections would as records of their own: the
    /// same counts, ids judged by each section's own record time, one outbox message
    /// per target for the whole record, and a replay of it all redelivered.
    #[test]
    fn a_bundle_applies_as_its_sections_would_one_by_one() {
        let two = StoreOptions { shards: 2, ..options() };
        let (far, here) = ("far", 1 - shard_of("far", 2));
        let day = 86_400_000;
        let increments = |entries: &[(i64, u32, &str, i64, Option<&str>)]| -> Vec<(Stamp, Increment)> {
            let increment = |entity: &str, delta, id: Option<&str>| Increment {
                entity: entity.into(),
                metric: "views".into(),
                delta,
                ts: NOW,
                id: id.map(Into::into),
            };
            entries
                .iter()
                .map(|&(o, i, entity, delta, id)| (Stamp { offset: o, index: i }, increment(entity, delta, id)))
                .collect()
        };
        // Partition 0 at NOW; partition 3 a day and more later, so its repeat of
        // partition 0's id counts again (past the window), and a repeat of its own
        // does not.
        let first = increments(&[(10, 0, "o", 4, Some("x")), (10, 1, "b", 1, None), (11, 0, "o", 2, None)]);
        let second = increments(&[(5, 0, "o", 8, Some("x")), (6, 0, "b", 3, Some("y")), (7, 0, "b", 3, Some("y"))]);
        let (p0, p3) =
            (Source { stream: Source::INCREMENTS, partition: 0 }, Source { stream: Source::INCREMENTS, partition: 3 });
        let (t0, t3) = (NOW, NOW + day + 1);
        let gain = desc_change(0, "o", &[far], &[]);
        let apply = |records: &[ShardRecord<'_>], dir: &std::path::Path| {
            let store = ShardStore::open(here, dir, two.clone()).unwrap();
            let report = store.apply(records, NOW + 2 * day, false).unwrap();
            let outbox = store.outbox().unwrap();
            // What the totals add up to per bucket (a bundle's are coalesced over
            // its sections).
            let mut sent: BTreeMap<(String, i64, i64), Count> = BTreeMap::new();
            for entry in &outbox {
                let ShardMessage::Totals { entries, .. } = ShardMessage::decode(&entry.payload).unwrap() else {
                    panic!("totals")
                };
                for (_, d) in entries {
                    *sent.entry((d.entity, d.width_ms, d.bucket)).or_default() += d.delta;
                }
            }
            let totals = (counts(&store, "o"), counts(&store, "b"));
            ((report.increments, report.duplicate_ids, report.redelivered), totals, sent, outbox.len(), store)
        };
        let dir = tempfile::tempdir().unwrap();
        let v2 = |source, entries: &[(Stamp, Increment)]| ShardMessage::encode_increments(source, entries, 2).unwrap();
        let (separate_0, separate_3) = (v2(p0, &first), v2(p3, &second));
        let separate = [
            ShardRecord { offset: 0, payload: &gain, timestamp: None },
            ShardRecord { offset: 1, payload: &separate_0, timestamp: Some(t0) },
            ShardRecord { offset: 2, payload: &separate_3, timestamp: Some(t3) },
        ];
        let (report, totals, sent, messages, _) = apply(&separate, &dir.path().join("separate"));
        assert_eq!(report, (5, 1, 0));
        assert_eq!(totals, (Counts { direct: 14, total: 14 }, Counts { direct: 4, total: 4 }));
        assert_eq!(messages, 2, "a message per record");

        let bundle = ShardMessage::bundle(&[(t0, separate_0.clone()), (t3, separate_3.clone())]).unwrap();
        // The Kafka header's time is not the sections': each uses its own.
        let bundled = [
            ShardRecord { offset: 0, payload: &gain, timestamp: None },
            ShardRecord { offset: 1, payload: &bundle, timestamp: Some(t0) },
        ];
        let (b_report, b_totals, b_sent, b_messages, store) = apply(&bundled, &dir.path().join("bundled"));
        assert_eq!((b_report, b_totals, b_sent), (report, totals, sent.clone()));
        assert_eq!(b_messages, 1, "one message for the whole record");
        assert_eq!(sent.len(), 3, "all-time, hour and day: {sent:?}");
        assert!(sent.iter().all(|((entity, ..), delta)| (entity.as_str(), *delta) == (far, 14)), "{sent:?}");
        // The ingester replays the same input in another bundle: all redelivered.
        let report =
            store.apply(&[ShardRecord { offset: 2, payload: &bundle, timestamp: None }], NOW + 2 * day, false).unwrap();
        assert_eq!((report.increments, report.redelivered), (0, 6));
        // A broken bundle stops the batch at it.
        let mut broken = tally_core::wire::packed::unpack(&bundle).unwrap().into_owned();
        broken.truncate(broken.len() - 1);
        let report = store.apply(&[ShardRecord { offset: 3, payload: &broken, timestamp: None }], NOW, false).unwrap();
        let (offset, reason) = report.undecodable.unwrap();
        assert_eq!((offset, store.progress().next_offset), (3, Some(3)));
        assert!(reason.contains("format version"), "{reason}");
    }

    /// Every count key of `entity` in the store, in key order.
    fn count_keys(store: &ShardStore, entity: &str) -> Vec<Vec<u8>> {
        let cf = store.cf(CF_COUNTS).unwrap();
        let mut prefix = Vec::new();
        tally_core::keys::encode_entity_prefix(&mut prefix, entity);
        store
            .store
            .db()
            .iterator_cf(cf, rocksdb::IteratorMode::Start)
            .map(|item| item.unwrap().0.to_vec())
            .filter(|key| key.starts_with(&prefix))
            .collect()
    }

    #[test]
    fn a_rollup_mark_stays_when_its_key_changed_after_the_value_was_published() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(1, 0, "a", 1, None), (1, 1, "b", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 0, payload: &first, timestamp: None }], NOW, true).unwrap();
        assert_eq!(report.marked, 8, "four buckets of each entity");
        let pending = store.pending_rollups(100).unwrap();
        assert_eq!(pending, [count_keys(&store, "a"), count_keys(&store, "b")].concat(), "marked for publishing");
        let (first, rest) = pending.split_at(3);
        assert_eq!(store.pending_rollups(3).unwrap(), first.to_vec(), "a page");
        assert_eq!(
            store.pending_rollups_after(first.last().map(Vec::as_slice), 100).unwrap(),
            rest.to_vec(),
            "the next page"
        );
        let published = store.rollup_page(pending.clone()).unwrap();
        // `a` changes while its old value is on the way to the broker.
        let later = message(0, &[(2, 0, "a", 1, None)]);
        let changed = store.apply(&[ShardRecord { offset: 1, payload: &later, timestamp: None }], NOW, true).unwrap();
        assert_eq!((changed.keys, changed.marked), (4, 0), "`a`'s marks are there already: not written again");
        store.rollups_published(published, NOW).unwrap();
        let left = store.pending_rollups(100).unwrap();
        assert_eq!(left, count_keys(&store, "a"), "`b`'s marks are gone, `a`'s stay for its newer value");
        store.rollups_published(store.rollup_page(left).unwrap(), NOW).unwrap();
        assert_eq!(store.pending_rollups(100).unwrap(), Vec::<Vec<u8>>::new());
        // Unmarked keys are forgotten: the next change marks them again.
        let again = message(0, &[(3, 0, "a", 1, None)]);
        let report = store.apply(&[ShardRecord { offset: 2, payload: &again, timestamp: None }], NOW, true).unwrap();
        assert_eq!(report.marked, 4);
        assert_eq!(store.pending_rollups(100).unwrap(), count_keys(&store, "a"));
    }

    #[test]
    fn every_change_is_published_while_rollups_run_alongside_the_batches() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(ShardStore::open(0, dir.path(), options()).unwrap());
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The rollups thread's part: publish pages of marks, unmark what is unchanged;
        // the last value published of each key. Each page's values are the shard's
        // at the page's position: `d`, counted once per record, holds its offset.
        let mut all_time_of_d = Vec::new();
        tally_core::keys::encode_count_key(&mut all_time_of_d, "d", "views", ALL_TIME_WIDTH, 0);
        let publisher = {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                let mut last = std::collections::BTreeMap::new();
                loop {
                    let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                    let pending = store.pending_rollups(3).unwrap();
                    if pending.is_empty() && finished {
                        return last;
                    }
                    let page = store.rollup_page(pending).unwrap();
                    for (key, value) in page.keys.iter().zip(&page.values) {
                        last.insert(key.clone(), value.clone());
                        if key == &all_time_of_d {
                            let counts = Counts::decode(value.as_deref().unwrap()).unwrap();
                            assert_eq!(counts.total, i128::from(page.offset), "d at its page's position");
                        }
                    }
                    std::thread::yield_now();
                    store.rollups_published(page, NOW).unwrap();
                }
            })
        };
        for offset in 0..400i64 {
            let entity = ["a", "b", "c"][offset as usize % 3];
            let record = message(0, &[(offset, 0, entity, 1, None), (offset, 1, "d", 1, None)]);
            store.apply(&[ShardRecord { offset, payload: &record, timestamp: None }], NOW, true).unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let published = publisher.join().unwrap();
        let keys: Vec<Vec<u8>> = ["a", "b", "c", "d"].iter().flat_map(|e| count_keys(&store, e)).collect();
        assert_eq!(keys.len(), 16);
        let published_keys: Vec<&Vec<u8>> = published.keys().collect();
        assert_eq!(published_keys, keys.iter().collect::<Vec<_>>(), "every changed key published");
        let now = store.rollup_page(keys.clone()).unwrap();
        for (key, value) in now.keys.iter().zip(&now.values) {
            assert_eq!(&published[key], value, "the last value published is the final one");
        }
    }

    #[test]
    fn a_corrupt_count_fails_reads_and_merges_instead_of_reading_as_zero() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(1, 0, "a", 2, None)]);
        store.apply(&[ShardRecord { offset: 0, payload: &first, timestamp: None }], NOW, false).unwrap();
        assert_eq!(counts(&store, "a"), Counts { direct: 2, total: 2 });
        // Bit rot, or a value of another format: 16 bytes without the version byte.
        let mut key = Vec::new();
        encode_count_key(&mut key, "a", "views", ALL_TIME_WIDTH, 0);
        store.store.db().put_cf(store.cf(CF_COUNTS).unwrap(), &key, [0u8; 16]).unwrap();
        let read = store.get_counts(&[key.clone()]).unwrap_err().to_string();
        assert!(read.contains("counts value: unknown format version 0"), "{read}");
        let more = message(0, &[(2, 0, "a", 3, None)]);
        store.apply(&[ShardRecord { offset: 1, payload: &more, timestamp: None }], NOW, false).unwrap();
        let merged = store.get_counts(&[key]).unwrap_err().to_string();
        assert!(merged.to_lowercase().contains("merge"), "the merge fails rather than adding to zero: {merged}");
    }

    #[test]
    fn a_gap_in_the_log_stops_the_batch_instead_of_skipping_records() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), options()).unwrap();
        let first = message(0, &[(1, 0, "a", 1, None)]);
        let later = message(0, &[(9, 0, "a", 5, None)]);
        let records = [
            ShardRecord { offset: 3, payload: &first, timestamp: None },
            ShardRecord { offset: 7, payload: &later, timestamp: None },
        ];
        let report = store.apply(&records, NOW, false).unwrap();
        assert_eq!((report.gap, report.increments), (Some((4, 7)), 1));
        assert_eq!(store.progress().next_offset, Some(4), "stays before the gap");
        assert_eq!(counts(&store, "a"), Counts { direct: 1, total: 1 });
    }

    mod direct_cache {
        use proptest::prelude::*;

        use super::*;

        #[derive(Debug, Clone)]
        enum Step {
            /// `(entity, metric, minutes before now, delta)`.
            Increments(Vec<(u8, u8, i64, i64)>),
            /// `(origin, added, removed)`; descendants `d0`/`d1` (either shard).
            Change(u8, Vec<u8>, Vec<u8>),
            /// The clock moves on this many minutes (buckets leave retention).
            Later(i64),
        }

        fn steps() -> impl Strategy<Value = Vec<Step>> {
            let increment = (0..4u8, 0..2u8, 0..480i64, -2i64..5);
            let increments = proptest::collection::vec(increment, 1..6).prop_map(Step::Increments);
            let names = || proptest::collection::vec(0..4u8, 0..3);
            let change =
                (0..4u8, names(), names()).prop_map(|(origin, added, removed)| Step::Change(origin, added, removed));
            let later = (0..200i64).prop_map(Step::Later);
            proptest::collection::vec(prop_oneof![3 => increments, 3 => change, 1 => later], 1..40)
        }

        fn record(offset: i64, step: &Step, now: i64) -> Option<Vec<u8>> {
            let stamp = |index: usize| Stamp { offset, index: index as u32 };
            let names = |list: &[u8]| {
                let mut names: Vec<String> = list.iter().map(|d| format!("d{d}")).collect();
                names.sort();
                names.dedup();
                names
            };
            let message = match step {
                Step::Increments(list) => ShardMessage::Increments {
                    source: Source { stream: Source::INCREMENTS, partition: 0 },
                    entries: list
                        .iter()
                        .enumerate()
                        .map(|(index, &(entity, metric, minutes, delta))| {
                            let increment = Increment {
                                entity: format!("e{entity}"),
                                metric: format!("m{metric}"),
                                delta,
                                ts: now - minutes * 60_000,
                                id: None,
                            };
                            (stamp(index), increment)
                        })
                        .collect(),
                },
                Step::Change(origin, added, removed) => {
                    let added = names(added);
                    let removed: Vec<String> = names(removed).into_iter().filter(|d| !added.contains(d)).collect();
                    let change = DescChange { origin: format!("e{origin}"), added, removed };
                    let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
                    ShardMessage::DescChanges { source, entries: vec![(stamp(0), change)] }
                }
                Step::Later(_) => return None,
            };
            Some(message.encode().unwrap())
        }

        /// Keys and values.
        type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

        /// Every count key and value, and the outbox, of a store.
        fn contents(store: &ShardStore) -> (Pairs, Pairs) {
            let cf = store.cf(CF_COUNTS).unwrap();
            let counts = store
                .store
                .db()
                .iterator_cf(cf, rocksdb::IteratorMode::Start)
                .map(|item| item.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
                .collect();
            let outbox = store.outbox().unwrap().into_iter().map(|e| (e.key, e.payload)).collect();
            (counts, outbox)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]
            /// A store that keeps origins' direct counts in memory (in a cache of any
            /// size, small ones turning over all the time) writes exactly what one
            /// that reads them from RocksDB every time writes: every count and every
            /// outbox record, byte for byte.
            #[test]
            fn the_cache_changes_nothing_a_store_writes(steps in steps(), capacity in prop_oneof![0usize..1_500, Just(8usize << 20)]) {
                let dir = tempfile::tempdir().unwrap();
                let open = |name: &str, direct_cache_bytes: usize| {
                    let options = StoreOptions { shards: 2, direct_cache_bytes, ..options() };
                    ShardStore::open(0, &dir.path().join(name), options).unwrap()
                };
                let (cached, uncached) = (open("cached", capacity), open("uncached", 0));
                let (mut now, mut offset) = (NOW, 0);
                for step in &steps {
                    if let Step::Later(minutes) = step {
                        now += minutes * 60_000;
                    }
                    let Some(payload) = record(offset, step, now) else { continue };
                    for store in [&cached, &uncached] {
                        let record = ShardRecord { offset, payload: &payload, timestamp: None };
                        let report = store.apply(&[record], now, false).unwrap();
                        prop_assert_eq!((report.gap, report.undecodable), (None, None));
                    }
                    prop_assert_eq!(contents(&cached), contents(&uncached), "after record {} ({:?})", offset, step);
                    offset += 1;
                }
            }
        }
    }
}

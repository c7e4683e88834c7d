//! The direct counts of origins whose descendant sets changed lately, kept in memory
//! so the next change of the same origins moves their counts without a seek.
//!
//! A record of descendant changes moves each origin's retained direct counts into
//! the totals of the descendants it gains or loses, so it reads them first: a prefix
//! scan of the origin's count keys, 64 % of the record's time in a profile of
//! `tally-bench graph`'s latency shape (BENCHMARKS.md, "Hierarchy"). An edge high in
//! the graph changes the same ancestors again and again (a topic's ancestors whenever
//! it moves), and differential-dataflow, the yardstick, keeps every count in memory.
//! So an origin read once is cached here with all its direct buckets, and every
//! committed increment of a cached entity is added to its copy.
//!
//! The rule that keeps it exact: an entry holds exactly what the store holds for
//! that entity's direct counts. Entries are made from a full prefix scan of the
//! committed store, and only the thread applying the shard's batch, which commits
//! every count, changes the store's direct counts; it adds a batch's direct deltas to the cached entities
//! after the batch committed (a failed commit leaves both as they were). Buckets at
//! zero are left out, as the scan skips them. A bucket past its retention at the
//! batch's `now` is dropped when met; compaction drops it from the store by its own
//! clock, a little later or — for a bucket expiring during the batch, or a clock that
//! moved back — sooner, so there a scan's own answer depends on when compaction ran
//! (a bucket at the edge of its retention, read by no window). Counts are decoded —
//! and a corrupt one fails the shard — when an entry is made from the scan; a hit
//! does not read the store (reads and merges of a corrupt count still fail it).
//!
//! Memory is bounded by an estimate of the bytes held ([`DirectCache::new`]), in two
//! generations of at most half of it each: entries are made and used in the young
//! one; when it is full, the old one is dropped and the young one becomes old. An
//! old entry used again moves back to the young one. A single entity larger than
//! half the bound is not cached (its scan is long anyway).

use std::collections::HashMap;
use std::mem;

use tally_core::keys::Count;

/// One metric of an entity: `(width_ms, bucket, direct)` in key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricBuckets {
    pub metric: String,
    pub buckets: Vec<(i64, i64, Count)>,
}

/// An entity's direct counts, by metric in key order.
pub type EntityDirect = Vec<MetricBuckets>;

/// What an entry is estimated to take, in bytes: the map's slot and the name, each
/// metric's header and name, 32 bytes a bucket.
fn footprint(entity: &str, direct: &EntityDirect) -> usize {
    64 + entity.len() + direct.iter().map(|m| 56 + m.metric.len() + 32 * m.buckets.capacity()).sum::<usize>()
}

/// Entities by name. Names come from producers, so the hash is seeded per process
/// (foldhash: cheaper than std's SipHash; an unseeded hash would let a producer pick
/// names that collide).
#[derive(Default)]
struct Generation {
    entries: HashMap<String, EntityDirect, foldhash::fast::RandomState>,
    bytes: usize,
}

/// Entities' direct counts (see the module docs).
pub struct DirectCache {
    young: Generation,
    old: Generation,
    capacity_bytes: usize,
}

impl DirectCache {
    /// A cache holding about `capacity_bytes` at most (0: caches nothing).
    pub fn new(capacity_bytes: usize) -> Self {
        Self { young: Generation::default(), old: Generation::default(), capacity_bytes }
    }

    /// Whether it caches anything at all (a bound above 0).
    pub fn caches(&self) -> bool {
        self.capacity_bytes > 0
    }

    pub fn is_empty(&self) -> bool {
        self.young.entries.is_empty() && self.old.entries.is_empty()
    }

    /// Whether `entity` is cached.
    pub fn contains(&self, entity: &str) -> bool {
        self.young.entries.contains_key(entity) || self.old.entries.contains_key(entity)
    }

    /// The direct counts of `entity` when cached, without the buckets `retained`
    /// says are gone (they are dropped) or at zero; the entry moves to the young
    /// generation.
    pub fn get(&mut self, entity: &str, retained: impl Fn(i64, i64) -> bool) -> Option<&EntityDirect> {
        if !self.young.entries.contains_key(entity) {
            let (name, direct) = self.old.entries.remove_entry(entity)?;
            let bytes = footprint(&name, &direct);
            self.old.bytes = self.old.bytes.saturating_sub(bytes);
            self.young.bytes += bytes;
            self.young.entries.insert(name, direct);
        }
        let direct = self.young.entries.get_mut(entity)?;
        let kept = |&(width_ms, bucket, value): &(i64, i64, Count)| value != 0 && retained(width_ms, bucket);
        if !direct.iter().all(|metric| metric.buckets.iter().all(kept)) {
            let before = footprint(entity, direct);
            for metric in direct.iter_mut() {
                metric.buckets.retain(kept);
            }
            direct.retain(|metric| !metric.buckets.is_empty());
            self.young.bytes = self.young.bytes.saturating_sub(before) + footprint(entity, direct);
        }
        Some(direct)
    }

    /// Caches `entity`'s direct counts as a full scan of the store found them.
    pub fn insert(&mut self, entity: &str, direct: EntityDirect) {
        let bytes = footprint(entity, &direct);
        if bytes > self.capacity_bytes / 2 {
            return;
        }
        self.make_room(bytes);
        if let Some(old) = self.old.entries.remove(entity) {
            self.old.bytes = self.old.bytes.saturating_sub(footprint(entity, &old));
        }
        if let Some(previous) = self.young.entries.insert(entity.to_string(), direct) {
            self.young.bytes = self.young.bytes.saturating_sub(footprint(entity, &previous));
        }
        self.young.bytes += bytes;
    }

    /// Adds a committed delta to one direct bucket of `entity`, when it is cached.
    pub fn add(&mut self, entity: &str, metric: &str, width_ms: i64, bucket: i64, delta: Count) {
        let generation = if self.young.entries.contains_key(entity) { &mut self.young } else { &mut self.old };
        let Some(direct) = generation.entries.get_mut(entity) else { return };
        let at = match direct.binary_search_by(|m| m.metric.as_str().cmp(metric)) {
            Ok(at) => at,
            Err(at) => {
                direct.insert(at, MetricBuckets { metric: metric.to_string(), buckets: Vec::new() });
                generation.bytes += 56 + metric.len();
                at
            }
        };
        let buckets = &mut direct[at].buckets;
        match buckets.binary_search_by(|&(w, b, _)| (w, b).cmp(&(width_ms, bucket))) {
            // Saturating, like the store's merge of counts (which no sum reaches).
            Ok(found) => buckets[found].2 = buckets[found].2.saturating_add(delta),
            Err(found) => {
                let capacity = buckets.capacity();
                buckets.insert(found, (width_ms, bucket, delta));
                generation.bytes += 32 * (buckets.capacity() - capacity);
            }
        }
        if self.young.bytes + self.old.bytes > self.capacity_bytes {
            self.make_room(0);
        }
    }

    /// Turns the generations over when the young one cannot take `bytes` more
    /// within half the bound; drops the old one when both would exceed the bound.
    fn make_room(&mut self, bytes: usize) {
        if self.young.bytes + bytes > self.capacity_bytes / 2 {
            self.old = mem::take(&mut self.young);
        }
        if self.young.bytes + self.old.bytes + bytes > self.capacity_bytes {
            self.old = Generation::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// The brute-force model: every direct bucket, by (entity, metric, width, bucket).
    type Model = BTreeMap<(String, String, i64, i64), Count>;

    /// What a full scan of the store finds for `entity` (non-zero buckets, key order).
    fn scan(model: &Model, entity: &str, retained: impl Fn(i64, i64) -> bool) -> EntityDirect {
        let mut direct: EntityDirect = Vec::new();
        for ((e, metric, width, bucket), value) in model {
            if e != entity || *value == 0 || !retained(*width, *bucket) {
                continue;
            }
            match direct.last_mut() {
                Some(last) if last.metric == *metric => last.buckets.push((*width, *bucket, *value)),
                _ => direct.push(MetricBuckets { metric: metric.clone(), buckets: vec![(*width, *bucket, *value)] }),
            }
        }
        direct
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A committed increment of a direct bucket.
        Add { entity: u8, metric: u8, width: i64, bucket: i64, delta: i64 },
        /// A descendant change reads an origin: from the cache, else by a scan
        /// that is then cached. The clock moves on by `later`: buckets below the
        /// horizon are past retention (all-time, width 0, never is).
        Read { entity: u8, later: i64 },
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let add = (0..6u8, 0..3u8, 0..3i64, 0..6i64, -3i64..4)
            .prop_map(|(entity, metric, width, bucket, delta)| Op::Add { entity, metric, width, bucket, delta });
        let read = (0..6u8, 0..2i64).prop_map(|(entity, later)| Op::Read { entity, later });
        proptest::collection::vec(prop_oneof![add, read], 0..150)
    }

    proptest! {
        /// Whatever the capacity, a read answers exactly what a scan of the store
        /// would: the cache never holds a stale or partial entity.
        #[test]
        fn reads_answer_what_a_scan_of_the_store_would(ops in ops(), capacity in 0usize..3_000) {
            let mut cache = DirectCache::new(capacity);
            let mut model = Model::new();
            let mut horizon = 0;
            for op in ops {
                match op {
                    Op::Add { entity, metric, width, bucket, delta } => {
                        let (entity, metric) = (format!("e{entity}"), format!("m{metric}"));
                        *model.entry((entity.clone(), metric.clone(), width, bucket)).or_default() += Count::from(delta);
                        cache.add(&entity, &metric, width, bucket, delta.into());
                    }
                    Op::Read { entity, later } => {
                        let entity = format!("e{entity}");
                        horizon += later;
                        let retained = |width: i64, bucket: i64| width == 0 || bucket >= horizon;
                        let expected = scan(&model, &entity, retained);
                        match cache.get(&entity, retained) {
                            Some(cached) => prop_assert_eq!(cached, &expected),
                            None => cache.insert(&entity, expected),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_small_cache_keeps_the_entities_used_last() {
        let direct = |value| vec![MetricBuckets { metric: "views".into(), buckets: vec![(0, 0, value)] }];
        let one = footprint("e0", &direct(1));
        let mut cache = DirectCache::new(4 * one);
        for (n, value) in (0..6).zip(1..) {
            cache.insert(&format!("e{n}"), direct(value));
            // e0 is used after every insert: it stays, in whichever generation.
            assert_eq!(cache.get("e0", |_, _| true), Some(&direct(1)), "after e{n}");
        }
        let held: Vec<bool> = (0..6).map(|n| cache.contains(&format!("e{n}"))).collect();
        assert_eq!(held, [true, false, false, false, true, true]);
        assert!(cache.young.bytes + cache.old.bytes <= 4 * one);
        cache.insert("huge", vec![MetricBuckets { metric: "views".into(), buckets: vec![(0, 0, 1); 200] }]);
        assert!(!cache.contains("huge"), "larger than half the bound: not cached");
    }
}

//! Segmented counters in a shard store ([`tally_core::segments`]): the cap on an
//! origin's combinations, and segment reads.
//!
//! **The cap.** The `segments` column family registers each combination an origin's
//! own increments used, `entity 0x00 segmented-metric`, in the write batch of the
//! increment that first used it. An increment whose combination is not registered
//! while its (entity, metric) already holds `max_segment_combinations` counts under
//! the metric's overflow combination instead. Whether a combination is admitted is a
//! function of the registrations before it in the shard's log, checked increment by
//! increment in log order (those of the batch so far included), so a replay cut into
//! other batches, a standby and a new owner all decide the same. Only origins'
//! increments register: a descendant's combinations are those its ancestors' caps
//! admitted. The first increment that overflows an (entity, metric) also writes a dead
//! letter (once: the overflow combination is then registered too, beyond the count).
//!
//! **Reads.** An (entity, metric)'s combinations are count keys right after its own
//! (`metric 0x01 …`): a segment read walks them once, seeking past each combination's
//! buckets, sums the buckets of those its selector picks per group, and answers the
//! shard's part of the query at once (an entity lives in one shard: all of it).

use std::collections::BTreeMap;
use std::sync::MutexGuard;

use rocksdb::WriteBatch;
use rustc_hash::{FxHashMap, FxHashSet};
use tally_core::format::PRESENT;
use tally_core::keys::{encode_entity_prefix, parse_count_key, Count};
use tally_core::segments::{combinations_prefix, Combination, Selected, Selector};
use tally_core::time::Plan;
use tally_core::wire::{Kind, ShardAnswer};

use crate::error::Result;
use crate::store::{ShardStore, CF_COUNTS};

/// Combinations registered by origins' increments: `entity 0x00 segmented-metric`;
/// an (entity, metric) that overflowed also holds its overflow combination's key.
pub(crate) const CF_SEGMENTS: &str = "segments";
/// Dead letters of the first increment that overflowed each (entity, metric),
/// written with it and relayed to the dead-letter topic by the shard's owner.
pub(crate) const CF_LETTERS: &str = "letters";
/// Most (entity, metric) counts of registered combinations kept in memory; past it
/// the cache starts again (a count is read again from the store when needed).
const MAX_CACHED: usize = 100_000;
/// Most combinations one segment query walks: an entity fed by many ancestors holds
/// the union of theirs. Past it the query is refused (`too_many_combinations`).
pub const MAX_COMBINATIONS_READ: usize = 100_000;
/// Most counts one segment answer holds (groups × points): a breakdown of a long
/// series by a dimension of many values is refused (`too_many_groups`).
pub const MAX_SEGMENT_CELLS: usize = 1_000_000;

/// How many combinations each (entity, metric) registered, as far as read.
#[derive(Default)]
pub(crate) struct Registered {
    counts: FxHashMap<(Box<str>, Box<str>), u32>,
}

/// The key of a registration.
fn registration_key(entity: &str, segmented: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(entity.len() + 1 + segmented.len());
    encode_entity_prefix(&mut key, entity);
    key.extend_from_slice(segmented.as_bytes());
    key
}

/// One write batch's admissions of combinations: holds the cache of registered
/// counts (second in the store's lock order) until [`Admissions::committed`].
pub(crate) struct Admissions<'s, 'a> {
    store: &'s ShardStore,
    registered: MutexGuard<'s, Registered>,
    max: u32,
    /// Registered, in this batch or before it (as far as this batch looked):
    /// `(entity, segmented metric)`.
    known: FxHashSet<(&'a str, &'a str)>,
    /// How many each (entity, metric) registered in this batch.
    added: FxHashMap<(&'a str, &'a str), u32>,
    /// Increments counted under their overflow combination.
    pub overflowed: u64,
    /// Dead letters written in this batch (their keys' numbers).
    letters: u32,
}

/// Where an increment came from, for its dead letter.
pub(crate) struct Origin<'a> {
    /// The shard record holding it.
    pub offset: i64,
    pub source: tally_core::wire::Source,
    pub stamp: tally_core::wire::Stamp,
    pub increment: &'a tally_core::wire::IncrementRef<'a>,
}

impl<'s, 'a> Admissions<'s, 'a> {
    pub(crate) fn new(store: &'s ShardStore) -> Self {
        Self {
            store,
            registered: tally_shared::lock::lock(&store.segments, "a shard's registered segment combinations"),
            max: store.options.max_segment_combinations.max(1),
            known: FxHashSet::default(),
            added: FxHashMap::default(),
            overflowed: 0,
            letters: 0,
        }
    }

    /// The segmented metric an origin's increment of `combination` counts under:
    /// its own, registered in `batch` when new and within the cap, or else its
    /// metric's overflow combination.
    pub(crate) fn admit(
        &mut self,
        batch: &mut WriteBatch,
        entity: &'a str,
        combination: Combination<'a>,
        origin: Origin<'_>,
    ) -> Result<&'a str> {
        if combination.is_overflow() || self.known.contains(&(entity, combination.full)) {
            return Ok(combination.full);
        }
        let cf = self.store.cf(CF_SEGMENTS)?;
        let key = registration_key(entity, combination.full);
        if self.store.store.db().get_pinned_cf(cf, &key)?.is_some() {
            self.known.insert((entity, combination.full));
            return Ok(combination.full);
        }
        let before = self.registered_before(entity, combination.metric)?;
        let added = self.added.entry((entity, combination.metric)).or_default();
        if before.saturating_add(*added) >= self.max {
            if self.overflowed == 0 {
                tracing::warn!(
                    shard = self.store.shard,
                    entity,
                    metric = combination.metric,
                    max = self.max,
                    "segment combinations at their cap (counting.max_segment_combinations): new ones count as overflow"
                );
            }
            self.overflowed += 1;
            let overflow = (entity, combination.overflow());
            let marker = registration_key(entity, combination.overflow());
            if self.known.insert(overflow) && self.store.store.db().get_pinned_cf(cf, &marker)?.is_none() {
                batch.put_cf(cf, &marker, PRESENT);
                self.put_letter(batch, combination, origin)?;
            }
            return Ok(combination.overflow());
        }
        *added += 1;
        self.known.insert((entity, combination.full));
        batch.put_cf(cf, &key, PRESENT);
        Ok(combination.full)
    }

    /// The combinations (entity, metric) registered before this batch.
    fn registered_before(&mut self, entity: &str, metric: &str) -> Result<u32> {
        let name = (Box::from(entity), Box::from(metric));
        if let Some(&count) = self.registered.counts.get(&name) {
            return Ok(count);
        }
        let cf = self.store.cf(CF_SEGMENTS)?;
        let prefix = registration_key(entity, &combinations_prefix(metric));
        let mut iterator = self.store.store.db().raw_iterator_cf(cf);
        iterator.seek(&prefix);
        let mut count = 0u32;
        while let Some(key) = iterator.key().filter(|key| key.starts_with(&prefix)) {
            // The overflow combination's key marks its letter, not a combination.
            count += u32::from(key.len() > prefix.len());
            iterator.next();
        }
        iterator.status()?;
        if self.registered.counts.len() >= MAX_CACHED {
            self.registered.counts.clear();
        }
        self.registered.counts.insert(name, count);
        Ok(count)
    }

    /// The dead letter of the first increment of (entity, metric) past its cap.
    fn put_letter(&mut self, batch: &mut WriteBatch, combination: Combination<'_>, origin: Origin<'_>) -> Result<()> {
        let increment = origin.increment;
        let segments: serde_json::Map<String, serde_json::Value> =
            combination.pairs().map(|(name, value)| (name.to_string(), value.into())).collect();
        let mut element = serde_json::json!({
            "entity": increment.entity, "metric": combination.metric, "delta": increment.delta, "ts": increment.ts,
            "segments": segments,
        });
        if let Some(id) = increment.id {
            element["id"] = id.into();
        }
        let reason = format!(
            "segments: {}'s {} holds {} combinations (counting.max_segment_combinations): this one and every later \
             new one count under its overflow",
            increment.entity, combination.metric, self.max
        );
        let letter = tally_core::wire::DeadLetter::encode(
            &self.store.options.increments_topic,
            origin.source.partition as i32,
            origin.stamp.offset,
            Some(origin.stamp.index),
            &reason,
            element.to_string().as_bytes(),
            self.store.options.record_budget,
        )?;
        let key = tally_shared::outbox::outbox_key(origin.offset, 0, self.letters);
        self.letters += 1;
        batch.put_cf(self.store.cf(CF_LETTERS)?, key, letter);
        Ok(())
    }

    /// The batch is committed: its registrations join the cached counts.
    pub(crate) fn committed(mut self) {
        for ((entity, metric), added) in self.added {
            if let Some(count) = self.registered.counts.get_mut(&(Box::from(entity), Box::from(metric))) {
                *count += added;
            }
        }
    }
}

impl ShardStore {
    /// Answers a segment query of (entity, metric) over `plan` from `snapshot`.
    pub(crate) fn read_segments(
        &self,
        snapshot: &rocksdb::Snapshot<'_>,
        (entity, metric, kind): (&str, &str, Kind),
        selector: &Selector,
        plan: &Plan,
        now: i64,
    ) -> Result<ShardAnswer> {
        let cf = self.cf(CF_COUNTS)?;
        let mut prefix = Vec::with_capacity(entity.len() + metric.len() + 2);
        encode_entity_prefix(&mut prefix, entity);
        prefix.extend_from_slice(combinations_prefix(metric).as_bytes());
        let points = plan.points as usize;
        let mut groups: BTreeMap<String, Vec<Count>> = BTreeMap::new();
        if selector.by.is_none() {
            groups.insert(String::new(), vec![0; points]);
        }
        let mut overflow = vec![0; points];
        let mut iterator = snapshot.raw_iterator_cf(cf);
        iterator.seek(&prefix);
        let mut walked = 0usize;
        while let Some(stored_key) = iterator.key().filter(|key| key.starts_with(&prefix)) {
            walked += 1;
            if walked > MAX_COMBINATIONS_READ {
                let message = format!(
                    "{entity}'s {metric} holds more than {MAX_COMBINATIONS_READ} segment combinations: too many for one read"
                );
                return Ok(ShardAnswer::Error { code: "too_many_combinations".into(), message });
            }
            if groups.len().saturating_add(1).saturating_mul(points) > MAX_SEGMENT_CELLS {
                let message = format!(
                    "more than {MAX_SEGMENT_CELLS} counts (groups × points): break down a shorter series or filter more"
                );
                return Ok(ShardAnswer::Error { code: "too_many_groups".into(), message });
            }
            let segmented = parse_count_key(stored_key)?.metric.to_string();
            let combination = Combination::of(&segmented)
                .ok_or_else(|| tally_core::Error::Format(format!("combination key {stored_key:?}: no combination")))?;
            let into = match selector.select(&combination) {
                Some(Selected::Group(group)) => {
                    Some(groups.entry(group.to_string()).or_insert_with(|| vec![0; points]))
                }
                Some(Selected::Overflow) => Some(&mut overflow),
                None => None,
            };
            if let Some(into) = into {
                let sums = self.points(snapshot, (entity, &segmented, kind), plan, now)?;
                for (sum, value) in into.iter_mut().zip(sums) {
                    *sum = sum.saturating_add(value);
                }
            }
            // Past every bucket of this combination: its keys go on with 0x00.
            let mut next = Vec::with_capacity(entity.len() + segmented.len() + 2);
            encode_entity_prefix(&mut next, entity);
            next.extend_from_slice(segmented.as_bytes());
            next.push(0x01);
            iterator.seek(&next);
        }
        iterator.status()?;
        if selector.by.is_some() {
            groups.retain(|_, points| points.iter().any(|value| *value != 0));
        }
        let (resolution, step) = match &plan.resolution {
            Some(resolution) => (resolution.name.clone(), plan.step),
            None => ("all".to_string(), 0),
        };
        let from = if plan.resolution.is_some() { plan.start } else { 0 };
        Ok(ShardAnswer::Segments {
            resolution,
            from,
            to: plan.to,
            step,
            groups: groups.into_iter().collect(),
            overflow,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use tally_core::graph::{EdgeOp, EdgeUpdate, Graph};
    use tally_core::model::Model;
    use tally_core::segments::Dimensions;
    use tally_core::time::WindowSpec;
    use tally_core::wire::{Increment, ShardMessage, ShardQuery, Source, Stamp};

    use super::*;
    use crate::store::apply::ShardRecord;
    use crate::store::StoreOptions;

    const NOW: i64 = 1_763_780_000_000;
    const DIMENSIONS: [&str; 3] = ["country", "state", "device"];

    #[derive(Debug, Clone)]
    enum Op {
        /// Entity, pairs `(dimension, value)` (none: a plain increment), delta, age in minutes.
        Increment(u8, Vec<(u8, u8)>, i64, i64),
        Graph(Vec<(bool, u8, u8)>),
        /// The batch ends here.
        Cut,
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let increment = (0..4u8, proptest::collection::vec((0..3u8, 0..3u8), 0..3), -2i64..6, 0i64..3 * 24 * 60)
            .prop_map(|(e, pairs, delta, age)| Op::Increment(e, pairs, delta, age));
        let graph = proptest::collection::vec((any::<bool>(), 0..4u8, 0..4u8), 1..3).prop_map(Op::Graph);
        proptest::collection::vec(prop_oneof![6 => increment, 1 => graph, 1 => Just(Op::Cut)], 0..60)
    }

    fn selectors() -> impl Strategy<Value = Vec<Selector>> {
        let filter = (0..3usize, proptest::option::of(0..3u8))
            .prop_map(|(d, v)| (DIMENSIONS[d].to_string(), v.map(|v| format!("v{v}"))));
        let selector = (proptest::collection::vec(filter, 0..2), proptest::option::of(0..3usize))
            .prop_map(|(filters, by)| Selector { filters, by: by.map(|d| DIMENSIONS[d].to_string()) });
        proptest::collection::vec(selector, 1..4)
    }

    fn dimensions() -> Dimensions {
        Dimensions::new(BTreeMap::from([("v".to_string(), DIMENSIONS.iter().map(|d| d.to_string()).collect())]))
            .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Segmented increments and graph changes, applied in batches cut anywhere,
        /// with a cap of two combinations per origin: every segment query (filters,
        /// wildcards, breakdowns; totals through ancestors; direct) of every entity
        /// and window answers as the model does, and plain reads as before.
        #[test]
        fn segment_reads_equal_the_model(ops in ops(), selectors in selectors()) {
            let dir = tempfile::tempdir().unwrap();
            let options = StoreOptions { max_segment_combinations: 2, ..StoreOptions::default() };
            let store = ShardStore::open(0, dir.path(), options).unwrap();
            let mut model = Model::with_max_combinations(2);
            let mut graph = Graph::default();
            let dims = dimensions();
            let (mut payloads, mut offset, mut seq) = (Vec::new(), 0i64, 0i64);
            let flush = |payloads: &mut Vec<(i64, Vec<u8>)>| {
                let records: Vec<ShardRecord> =
                    payloads.iter().map(|(offset, payload)| ShardRecord { offset: *offset, payload, timestamp: None }).collect();
                store.apply(&records, NOW, true).unwrap();
                payloads.clear();
            };
            for op in ops {
                match op {
                    Op::Increment(e, pairs, delta, age) => {
                        let values: Vec<(String, String)> = pairs.iter().map(|&(d, v)| (DIMENSIONS[d as usize].to_string(), format!("v{v}"))).collect();
                        let mut unique: BTreeMap<&str, &str> = BTreeMap::new();
                        for (d, v) in &values {
                            unique.insert(d, v);
                        }
                        let segments: Vec<(&str, &str)> = unique.into_iter().collect();
                        let metric = dims.segmented("v", &segments).unwrap().unwrap_or_else(|| "v".to_string());
                        let increment = Increment { entity: format!("e{e}"), metric, delta, ts: NOW - age * 60_000, id: None };
                        model.apply(increment.clone());
                        let source = Source { stream: Source::INCREMENTS, partition: 0 };
                        let record = ShardMessage::Increments { source, entries: vec![(Stamp { offset, index: 0 }, increment)] };
                        payloads.push((offset, record.encode().unwrap()));
                        offset += 1;
                    }
                    Op::Graph(updates) => {
                        let updates: Vec<EdgeUpdate> = updates
                            .into_iter()
                            .filter(|(_, f, t)| f != t)
                            .map(|(add, f, t)| EdgeUpdate { op: if add { EdgeOp::Add } else { EdgeOp::Remove }, from: format!("e{f}"), to: format!("e{t}") })
                            .collect();
                        for update in &updates {
                            model.apply_edge(update.op == EdgeOp::Add, &update.from, &update.to, None);
                        }
                        for change in graph.apply_batch(&updates) {
                            let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
                            let record = ShardMessage::DescChanges { source, entries: vec![(Stamp { offset: seq, index: 0 }, change)] };
                            payloads.push((offset, record.encode().unwrap()));
                            (offset, seq) = (offset + 1, seq + 1);
                        }
                    }
                    Op::Cut => flush(&mut payloads),
                }
            }
            flush(&mut payloads);

            let specs = [
                WindowSpec::All,
                WindowSpec::Last { window_ms: 30 * 60_000 },
                WindowSpec::Series { step_ms: 3_600_000, range_ms: 24 * 3_600_000 },
            ];
            for spec in specs {
                let plan = store.options.resolutions.plan(spec, NOW).unwrap();
                for e in 0..4 {
                    let entity = format!("e{e}");
                    for kind in [Kind::Total, Kind::Direct] {
                        let mut queries = vec![ShardQuery::plain(entity.clone(), "v".into(), kind, spec)];
                        for selector in &selectors {
                            queries.push(ShardQuery { segments: Some(selector.clone()), ..queries[0].clone() });
                        }
                        let answers = store.read(&queries, NOW).unwrap();
                        let plain: Vec<Count> = match &answers[0] {
                            ShardAnswer::Window { value, .. } => vec![*value],
                            ShardAnswer::Series { points, .. } => points.iter().map(|p| p.1).collect(),
                            other => panic!("{other:?}"),
                        };
                        prop_assert_eq!(plain, model.sums(&entity, "v", kind, &plan), "{} {:?} {:?}", entity, kind, spec);
                        for (selector, answer) in selectors.iter().zip(&answers[1..]) {
                            let ShardAnswer::Segments { groups, overflow, .. } = answer else { panic!("{answer:?}") };
                            let got: BTreeMap<String, Vec<Count>> = groups.iter().cloned().collect();
                            let (expected, expected_overflow) = model.segment_sums(&entity, "v", kind, &plan, selector);
                            prop_assert_eq!(&got, &expected, "{} {:?} {:?} {:?}", entity, kind, spec, selector);
                            prop_assert_eq!(overflow, &expected_overflow);
                        }
                    }
                }
            }
        }
    }

    /// A breakdown whose answer would pass the bound of counts is refused, naming it.
    #[test]
    fn a_breakdown_past_the_bound_of_counts_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(0, dir.path(), StoreOptions::default()).unwrap();
        let dims = dimensions();
        let entries = (0..1_200u32)
            .map(|i| {
                let metric = dims.segmented("v", &[("state", &format!("s{i}"))]).unwrap().unwrap();
                (Stamp { offset: 0, index: i }, Increment { entity: "e".into(), metric, delta: 1, ts: NOW, id: None })
            })
            .collect();
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let payload = ShardMessage::Increments { source, entries }.encode().unwrap();
        store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, false).unwrap();
        let by_state = Some(Selector { filters: vec![], by: Some("state".into()) });
        // 840 hourly points × 1 200 states: past the bound; a day of them is not.
        let read = |range_ms: u64| {
            let spec = WindowSpec::Series { step_ms: 3_600_000, range_ms };
            let query = ShardQuery {
                segments: by_state.clone(),
                ..ShardQuery::plain("e".into(), "v".into(), Kind::Total, spec)
            };
            store.read(&[query], NOW).unwrap().remove(0)
        };
        let ShardAnswer::Error { code, message } = read(35 * 86_400_000) else { panic!("answered") };
        assert_eq!(code, "too_many_groups", "{message}");
        let ShardAnswer::Segments { groups, .. } = read(86_400_000) else { panic!("refused") };
        assert_eq!(groups.len(), 1_200);
    }

    #[test]
    fn past_the_cap_new_combinations_overflow_and_listings_show_plain_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions { max_segment_combinations: 1, ..StoreOptions::default() };
        let store = ShardStore::open(0, dir.path(), options).unwrap();
        let dims = dimensions();
        let increment = |country: &str, delta| Increment {
            entity: "e".into(),
            metric: dims.segmented("v", &[("country", country)]).unwrap().unwrap(),
            delta,
            ts: NOW,
            id: None,
        };
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let entries = vec![
            (Stamp { offset: 0, index: 0 }, increment("US", 1)),
            (Stamp { offset: 0, index: 1 }, increment("FR", 2)),
            (Stamp { offset: 0, index: 2 }, increment("US", 4)),
        ];
        let payload = ShardMessage::Increments { source, entries }.encode().unwrap();
        let report = store.apply(&[ShardRecord { offset: 0, payload: &payload, timestamp: None }], NOW, true).unwrap();
        assert_eq!(report.segment_overflows, 1);
        let by_country = Selector { filters: vec![], by: Some("country".into()) };
        let query = ShardQuery {
            segments: Some(by_country),
            ..ShardQuery::plain("e".into(), "v".into(), Kind::Total, WindowSpec::All)
        };
        let answers = store.read(&[query.clone(), ShardQuery { segments: None, ..query }], NOW).unwrap();
        assert_eq!(
            answers,
            vec![
                ShardAnswer::Segments {
                    resolution: "all".into(),
                    from: 0,
                    to: NOW,
                    step: 0,
                    groups: vec![("US".into(), vec![5])],
                    overflow: vec![2],
                },
                ShardAnswer::Window { value: 7, resolution: "all".into(), from: 0, to: NOW },
            ]
        );
        let listing = store.metrics("e", None, 10).unwrap();
        assert_eq!(listing.metrics.iter().map(|m| (m.metric.as_str(), m.total)).collect::<Vec<_>>(), vec![("v", 7)]);

        // The first overflow of (e, v) wrote a dead letter naming it; a later one writes none.
        let letters = store.letters().unwrap();
        assert_eq!(letters.len(), 1);
        let letter: serde_json::Value = serde_json::from_slice(&letters[0].payload).unwrap();
        assert_eq!(
            (
                letter["topic"].as_str(),
                letter["partition"].as_i64(),
                letter["offset"].as_i64(),
                letter["index"].as_i64()
            ),
            (Some("tally.increments"), Some(0), Some(0), Some(1))
        );
        assert_eq!(
            letter["reason"],
            "segments: e's v holds 1 combinations (counting.max_segment_combinations): this one and every later new one \
             count under its overflow"
        );
        use base64::Engine;
        let element = base64::engine::general_purpose::STANDARD.decode(letter["payload"].as_str().unwrap()).unwrap();
        let element: serde_json::Value = serde_json::from_slice(&element).unwrap();
        assert_eq!(
            element,
            serde_json::json!({"entity": "e", "metric": "v", "delta": 2, "ts": NOW, "segments": {"country": "FR"}})
        );
        let later = vec![(Stamp { offset: 1, index: 0 }, increment("DE", 1))];
        let payload = ShardMessage::Increments { source, entries: later }.encode().unwrap();
        let report = store.apply(&[ShardRecord { offset: 1, payload: &payload, timestamp: None }], NOW, true).unwrap();
        assert_eq!(
            (report.segment_overflows, store.letters().unwrap().len()),
            (1, 1),
            "one letter per entity and metric"
        );
    }
}

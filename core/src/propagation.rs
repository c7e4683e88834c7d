//! How a counter shard keeps totals eagerly: the rule the counter applies
//! to each message of its log, as pure functions.
//!
//! A shard keeps, for each origin `a` it owns, a view of desc(a). An increment on `a`
//! adds to direct(a) and total(a), and to total(d) for every d in the view. A
//! [`DescChange`] for `a` switches the view at that point of the log and moves a's
//! retained direct counts: added to each new descendant's totals, subtracted from
//! each lost one's. Every origin switches in its own log, so whatever the
//! interleaving of increments and graph updates, once every change has been applied
//! total(d) = direct(d) + Σ direct(a) over the a whose current view holds d.
//! What a shard sends other shards is stamped by [`stamp_totals`], so that a replay
//! at another clock is exact.

use crate::keys::{Count, ALL_TIME_WIDTH};
use crate::time::Resolutions;
use crate::wire::{Stamp, TotalDelta};

/// The total deltas a change makes, given the origin's direct value under each key
/// (`(key, value)`, for every metric and retained bucket): `(descendant, key, delta)`.
pub fn change_deltas<'c, 'd, S: AsRef<str>, K: Copy + 'd>(
    (added, removed): (&'c [S], &'c [S]),
    direct: &'d [(K, Count)],
) -> impl Iterator<Item = (&'c str, K, Count)> + use<'c, 'd, S, K> {
    let signed = added.iter().map(|d| (d, 1)).chain(removed.iter().map(|d| (d, -1)));
    signed.flat_map(move |(d, sign)| {
        direct.iter().filter(|(_, value)| *value != 0).map(move |&(key, value)| (d.as_ref(), key, sign * value))
    })
}

/// The totals one record of a shard's log sends one other shard, stamped with the
/// record's `offset` and an index in an order a replay keeps.
///
/// A record is applied again after its shard moves (a restore replays the log after
/// the snapshot; a stale owner may still be applying it), at another clock, while the
/// first run's messages may have partly reached the receiver, which drops every stamp
/// at or below its high-water mark. What a run sends is the same candidates (they
/// follow from the log) less those whose bucket expired by its clock. Numbered
/// latest-expiring first, a later clock drops only a tail and an earlier one adds a
/// tail, so every entry both runs send has the same stamp in both: the receiver
/// applies each entry once, whatever prefix of the other run it had. (Numbered in key
/// order, one expired minute would shift every later entry under the mark.)
pub fn stamp_totals(offset: i64, totals: Vec<TotalDelta>, resolutions: &Resolutions) -> Vec<(Stamp, TotalDelta)> {
    let mut by_expiry: Vec<(i64, TotalDelta)> =
        totals.into_iter().map(|total| (expiry(resolutions, total.width_ms, total.bucket), total)).collect();
    by_expiry.sort_unstable_by(|(a_expiry, a), (b_expiry, b)| {
        b_expiry.cmp(a_expiry).then_with(|| {
            (&a.entity, &a.metric, a.width_ms, a.bucket, a.delta)
                .cmp(&(&b.entity, &b.metric, b.width_ms, b.bucket, b.delta))
        })
    });
    by_expiry.into_iter().zip(0u32..).map(|((_, total), index)| (Stamp { offset, index }, total)).collect()
}

/// When a bucket stops being retained (it is while `now` is below this): never for
/// the all-time bucket, at once for a width no resolution has.
pub fn expiry(resolutions: &Resolutions, width_ms: i64, bucket: i64) -> i64 {
    if width_ms == ALL_TIME_WIDTH {
        return i64::MAX;
    }
    resolutions
        .by_width(width_ms)
        .map_or(i64::MIN, |r| bucket.saturating_add(r.width_ms).saturating_add(r.retention_ms))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap, VecDeque};

    use proptest::prelude::*;

    use super::*;
    use crate::counting::Coalescer;
    use crate::graph::{apply_change, DescChange, EdgeOp, EdgeUpdate, Graph};
    use crate::keys::Counts;
    use crate::model::Model;
    use crate::time::{bucket_start, Resolution};
    use crate::wire::Increment;

    const NOW: i64 = 1_763_780_000_000;

    #[derive(Debug, Clone)]
    enum Op {
        Increment(Increment),
        Graph(Vec<EdgeUpdate>),
        /// The shards catch up on this many pending descendant-set changes.
        Deliver(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let increment = (0..6u8, 0..2u8, -3i64..10, 0i64..3 * 86_400_000).prop_map(|(e, m, delta, age)| {
            Op::Increment(Increment {
                entity: format!("e{e}"),
                metric: format!("m{m}"),
                delta,
                ts: NOW - age,
                id: None,
            })
        });
        let update = (any::<bool>(), 0..6u8, 0..6u8).prop_map(|(add, f, t)| EdgeUpdate {
            op: if add { EdgeOp::Add } else { EdgeOp::Remove },
            from: format!("e{f}"),
            to: format!("e{t}"),
        });
        let op = prop_oneof![
            4 => increment,
            2 => proptest::collection::vec(update, 1..5).prop_map(Op::Graph),
            1 => (0usize..6).prop_map(Op::Deliver),
        ];
        proptest::collection::vec(op, 0..120)
    }

    type Key = (String, String, i64, i64);

    /// Every bucket key an increment touches (all-time and each retained resolution).
    fn bucket_keys(resolutions: &Resolutions, increment: &Increment) -> Vec<(String, i64, i64)> {
        let mut coalescer = Coalescer::new(resolutions, NOW);
        coalescer.add(&increment.entity, &increment.metric, increment.ts, Counts::default());
        let mut keys = Vec::new();
        coalescer.for_each(|_, metric, width, bucket, _| keys.push((metric.to_string(), width, bucket)));
        keys
    }

    fn add(store: &mut BTreeMap<Key, Counts>, entity: &str, key: &(String, i64, i64), counts: Counts) {
        let slot = store.entry((entity.to_string(), key.0.clone(), key.1, key.2)).or_default();
        *slot = *slot + counts;
    }

    /// A total as a sortable tuple.
    type Entry = (String, String, i64, i64, Count);

    fn entry(total: &TotalDelta) -> Entry {
        (total.entity.clone(), total.metric.clone(), total.width_ms, total.bucket, total.delta)
    }

    /// A record's totals for one shard: all-time and minute/hour buckets around their
    /// retention's end (10 min and 2 h here), duplicates included.
    fn totals() -> impl Strategy<Value = Vec<TotalDelta>> {
        let total = (0..3u8, 0..2u8, 0..3usize, 0i64..3 * 3_600_000, -3i64..4).prop_map(|(e, m, width, age, delta)| {
            let width_ms = [ALL_TIME_WIDTH, 60_000, 3_600_000][width];
            let bucket = if width_ms == ALL_TIME_WIDTH { 0 } else { bucket_start(NOW - age, width_ms) };
            TotalDelta { entity: format!("e{e}"), metric: format!("m{m}"), width_ms, bucket, delta: delta.into() }
        });
        proptest::collection::vec(total, 0..60)
    }

    proptest! {
        /// A record's totals sent by a run at one clock, of which the receiver got any
        /// prefix (its high-water stamp), then sent again by a run at another clock
        /// (later or earlier): the receiver applies every total the second run keeps
        /// exactly once, besides what it had.
        #[test]
        fn a_replay_at_another_clock_stamps_what_it_keeps_as_the_first_run(
            totals in totals(),
            first_ms in 0i64..3 * 3_600_000,
            second_ms in 0i64..3 * 3_600_000,
            received in 0usize..61,
        ) {
            let resolutions = Resolutions::new(vec![Resolution::new("1m", "10m").unwrap(), Resolution::new("1h", "2h").unwrap()]).unwrap();
            let run = |now: i64| {
                let kept = totals.iter().filter(|t| expiry(&resolutions, t.width_ms, t.bucket) > now).cloned().collect();
                stamp_totals(7, kept, &resolutions)
            };
            let (first, second) = (run(NOW + first_ms), run(NOW + second_ms));
            let had = &first[..received.min(first.len())];
            let mark = had.last().map(|(stamp, _)| *stamp);
            let mut applied: Vec<Entry> = had.iter().map(|(_, t)| entry(t)).collect();
            applied.extend(second.iter().filter(|(stamp, _)| mark.is_none_or(|mark| *stamp > mark)).map(|(_, t)| entry(t)));
            // Expected: what the receiver had, and what the second run keeps less one
            // copy of each entry it had.
            let mut expected: Vec<Entry> = second.iter().map(|(_, t)| entry(t)).collect();
            for (_, total) in had {
                if let Some(at) = expected.iter().position(|e| *e == entry(total)) {
                    expected.swap_remove(at);
                }
            }
            expected.extend(had.iter().map(|(_, t)| entry(t)));
            applied.sort();
            expected.sort();
            prop_assert_eq!(applied, expected);
            prop_assert!(second.iter().map(|(s, _)| s.index).eq(0..second.len() as u32));
        }

        /// Shards that switch views in their own logs, with graph changes arriving
        /// late and interleaved at random with increments, end with every bucket's
        /// direct and total equal to the model's recomputation on the final graph.
        #[test]
        fn eager_totals_equal_the_model(ops in ops()) {
            let resolutions = Resolutions::default();
            let mut graph = Graph::default();
            let mut views: HashMap<String, Vec<String>> = HashMap::new();
            let mut pending: VecDeque<DescChange> = VecDeque::new();
            let mut store: BTreeMap<Key, Counts> = BTreeMap::new();
            let mut model = Model::default();

            let deliver = |change: DescChange, views: &mut HashMap<String, Vec<String>>, store: &mut BTreeMap<Key, Counts>| {
                apply_change(views.entry(change.origin.clone()).or_default(), &change.added, &change.removed);
                let direct: Vec<((String, i64, i64), Count)> = store
                    .iter()
                    .filter(|((entity, ..), _)| *entity == change.origin)
                    .map(|((_, metric, width, bucket), counts)| ((metric.clone(), *width, *bucket), counts.direct))
                    .collect();
                let keys: Vec<(usize, Count)> = direct.iter().enumerate().map(|(i, (_, v))| (i, *v)).collect();
                for (d, i, delta) in change_deltas((&change.added, &change.removed), &keys) {
                    add(store, d, &direct[i].0, Counts::descendant(delta));
                }
            };

            for op in ops {
                match op {
                    Op::Increment(increment) => {
                        let view = views.get(&increment.entity).cloned().unwrap_or_default();
                        for key in bucket_keys(&resolutions, &increment) {
                            add(&mut store, &increment.entity, &key, Counts::increment(increment.delta));
                            for d in &view {
                                add(&mut store, d, &key, Counts::descendant(increment.delta.into()));
                            }
                        }
                        model.apply(increment);
                    }
                    Op::Graph(batch) => {
                        for update in &batch {
                            model.apply_edge(update.op == EdgeOp::Add, &update.from, &update.to, None);
                        }
                        pending.extend(graph.apply_batch(&batch));
                    }
                    Op::Deliver(n) => {
                        for _ in 0..n {
                            if let Some(change) = pending.pop_front() {
                                deliver(change, &mut views, &mut store);
                            }
                        }
                    }
                }
            }
            while let Some(change) = pending.pop_front() {
                deliver(change, &mut views, &mut store);
            }

            // The model's buckets: every event counts directly on its entity and in
            // the total of its entity and every final descendant.
            let mut expected: BTreeMap<Key, Counts> = BTreeMap::new();
            for event in model.events() {
                for key in bucket_keys(&resolutions, event) {
                    add(&mut expected, &event.entity, &key, Counts::increment(event.delta));
                    for d in model.descendants(&event.entity) {
                        add(&mut expected, &d, &key, Counts::descendant(event.delta.into()));
                    }
                }
            }
            store.retain(|_, counts| *counts != Counts::default());
            expected.retain(|_, counts| *counts != Counts::default());
            prop_assert_eq!(store, expected);
        }
    }
}

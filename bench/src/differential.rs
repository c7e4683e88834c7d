//! differential-dataflow (DD) computing hierarchical counters on the latency shape of
//! `tally-bench graph`, so tally's edge-update latency is printed against DD's
//! measured in the same run on the same machine (not against a figure from
//! elsewhere).
//!
//! The dataflow is what a DD user would write for tally's counting rule: the
//! transitive closure of the child → parent edges (`reach`), joined with each
//! entity's direct counts per time bucket, plus the entity's own, counted per
//! (entity, bucket). Leaves' counts are given (the same ones tally's shard holds), in
//! `buckets` time buckets each (tally keeps every count in its three resolutions and
//! the all-time row: 4). One worker, in memory; an update is timed from handing the
//! edge to the input until the output has caught up with it.
//!
//! Entity ids: leaves `0..leaves`, mids next, tops next, then the root; leaf `i`
//! belongs to mid `i / ceil(leaves / mids)`, mid `j` to top `j / ceil(mids / tops)`
//! (the shape of `crate::counter_graph::edge_latency`).

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

use differential_dataflow::input::Input;
use differential_dataflow::operators::Iterate;
use timely::dataflow::operators::probe::Handle;

/// The graph and the counts the updates run on.
#[derive(Debug, Clone)]
pub struct Shape {
    pub mids: u32,
    pub tops: u32,
    /// Direct count of every leaf (its index is the leaf's number).
    pub leaf_counts: Vec<i64>,
    /// Time buckets each count is kept in.
    pub buckets: u8,
    /// Adds and removes timed (the report has their medians).
    pub repeats: usize,
}

/// Medians in seconds, and the root's total in bucket 0 after the first add and the
/// first remove (the add's must equal the top's total; the remove's is 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub add_seconds: f64,
    pub remove_seconds: f64,
    pub root_after_add: i64,
    pub root_after_remove: i64,
}

/// Loads the shape, then adds and removes `top 0 → root` `repeats` times.
pub fn edge_latency(shape: &Shape) -> Report {
    let shape = shape.clone();
    timely::execute_directly(move |worker| {
        let leaves = shape.leaf_counts.len() as u32;
        let (mids, tops) = (shape.mids.max(1), shape.tops.max(1));
        let (top0, root) = (leaves + mids, leaves + mids + tops);
        let root_total = Rc::new(Cell::new(0i64));
        let seen = Rc::clone(&root_total);
        let probe = Handle::new();
        let (mut edges, mut counts) = worker.dataflow::<u32, _, _>(|scope| {
            let (edge_input, edges) = scope.new_collection::<(u32, u32), isize>();
            let (count_input, counts) = scope.new_collection::<(u32, u8), isize>();
            let reach = edges.clone().iterate(|scope, inner| {
                let edges = edges.enter(scope);
                inner
                    .map(|(origin, via)| (via, origin))
                    .join_map(edges.clone(), |_via, origin, parent| (*origin, *parent))
                    .concat(edges)
                    .distinct()
            });
            reach
                .join_map(counts.clone(), |_origin, descendant, bucket| (*descendant, *bucket))
                .concat(counts)
                .count()
                // `count` retracts the old total as it adds the new one: their sum
                // weighted by the diffs is the current total.
                .inspect(move |(((entity, bucket), total), _time, diff)| {
                    if *entity == root && *bucket == 0 {
                        seen.set(seen.get() + *total as i64 * *diff as i64);
                    }
                })
                .probe_with(&probe);
            (edge_input, count_input)
        });
        let per_mid = leaves.div_ceil(mids);
        let per_top = mids.div_ceil(tops);
        for leaf in 0..leaves {
            edges.insert((leaf, leaves + leaf / per_mid));
        }
        for mid in 0..mids {
            edges.insert((leaves + mid, top0 + mid / per_top));
        }
        for (leaf, count) in shape.leaf_counts.iter().enumerate().filter(|(_, count)| **count != 0) {
            for bucket in 0..shape.buckets {
                counts.update((leaf as u32, bucket), *count as isize);
            }
        }
        let mut round = 1;
        let mut settle = |edges: &mut differential_dataflow::input::InputSession<u32, (u32, u32), isize>,
                          counts: &mut differential_dataflow::input::InputSession<u32, (u32, u8), isize>,
                          worker: &mut timely::worker::Worker| {
            edges.advance_to(round);
            counts.advance_to(round);
            edges.flush();
            counts.flush();
            round += 1;
            worker.step_while(|| probe.less_than(edges.time()));
        };
        settle(&mut edges, &mut counts, worker);
        let (mut adds, mut removes) = (Vec::new(), Vec::new());
        let (mut root_after_add, mut root_after_remove) = (None, None);
        for _ in 0..shape.repeats.max(1) {
            let started = Instant::now();
            edges.insert((top0, root));
            settle(&mut edges, &mut counts, worker);
            adds.push(started.elapsed().as_secs_f64());
            root_after_add.get_or_insert(root_total.get());
            let started = Instant::now();
            edges.remove((top0, root));
            settle(&mut edges, &mut counts, worker);
            removes.push(started.elapsed().as_secs_f64());
            root_after_remove.get_or_insert(root_total.get());
        }
        Report {
            add_seconds: median(&mut adds),
            remove_seconds: median(&mut removes),
            root_after_add: root_after_add.unwrap_or_default(),
            root_after_remove: root_after_remove.unwrap_or_default(),
        }
    })
}

fn median(runs: &mut [f64]) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The root's total after the add is the sum of top 0's leaves (half of them in
    /// this shape), 0 after the remove.
    #[test]
    fn the_root_totals_the_tops_leaves_then_nothing() {
        // 12 leaves → 4 mids (3 leaves each) → 2 tops (2 mids each): top 0 has leaves 0..6.
        let leaf_counts: Vec<i64> = (1..=12).collect();
        let report = edge_latency(&Shape { mids: 4, tops: 2, leaf_counts, buckets: 4, repeats: 3 });
        assert_eq!((report.root_after_add, report.root_after_remove), ((1..=6).sum::<i64>(), 0));
        assert!(report.add_seconds > 0.0 && report.remove_seconds > 0.0, "{report:?}");
    }
}

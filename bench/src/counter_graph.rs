//! `tally-bench graph`: what hierarchy costs, each figure against a baseline run in
//! the same process.
//!
//! 1. An edge add `u → v` whose ancestor side has `ancestors` entities (`a_i → u`):
//!    the graph processor's incremental batch step against recomputing every
//!    entity's descendant set before and after (what a system without the
//!    affected-origins rule would do); then the counter shards applying the
//!    resulting descendant changes (each origin's retained buckets moved into `v`
//!    and `w`'s totals).
//! 2. A batch of `increments` on leaves with three levels of ancestors
//!    (`leaf → l1 → l2 → l3`) against the same batch on leaves without ancestors.
//! 3. Latency, end to end in process, in the shape of differential-dataflow's
//!    figure: 20 k leaves → 200 mids → 20 tops with Zipf-skewed increments on the
//!    leaves; an edge from a top to a fresh root is added, then removed. Its ancestor
//!    side is the top, its 10 mids and their 1 000 leaves: the graph step, then one
//!    shard (all entities local) applying the descendant changes.

use std::path::Path;
use std::time::Instant;

use tally_core::graph::{DescChange, EdgeOp, EdgeUpdate, Graph};
use tally_core::wire::{Increment, ShardMessage, Source, Stamp};

use tally_counter::error::Result;
use tally_counter::store::apply::ShardRecord;
use tally_counter::store::{ShardStore, StoreOptions};

#[derive(Debug, Clone)]
pub struct GraphBenchOptions {
    /// Entities on the ancestor side of the added edge.
    pub ancestors: usize,
    /// Edges elsewhere in the graph that the add does not affect (the rest of a real
    /// graph: a recompute has to visit them, the incremental step does not).
    pub bystanders: usize,
    /// Increments in the batch on entities with three levels of ancestors.
    pub increments: usize,
    /// Shards the descendants are spread over (1: every total is local).
    pub shards: u32,
}

impl Default for GraphBenchOptions {
    fn default() -> Self {
        Self { ancestors: 10_000, bystanders: 100_000, increments: 10_000, shards: 8 }
    }
}

#[derive(Debug, Clone)]
pub struct GraphBenchReport {
    pub changes: usize,
    pub incremental_seconds: f64,
    pub recompute_seconds: f64,
    /// Applying the changes in a counter shard (reads each origin's buckets, writes
    /// the descendants' totals or the outbox).
    pub shard_apply_seconds: f64,
    pub hierarchy_seconds: f64,
    pub flat_seconds: f64,
    /// Outbox messages the hierarchical batch wrote (totals for other shards).
    pub outbox_messages: u64,
}

const NOW_OFFSET_MS: i64 = 5_000;

fn increments_record(offset: i64, entities: impl Iterator<Item = String>, now: i64) -> Vec<u8> {
    let entries = entities
        .enumerate()
        .map(|(index, entity)| {
            let increment = Increment { entity, metric: "views".into(), delta: 1, ts: now - NOW_OFFSET_MS, id: None };
            (Stamp { offset, index: index as u32 }, increment)
        })
        .collect();
    ShardMessage::Increments { source: Source { stream: Source::INCREMENTS, partition: 0 }, entries }
        .encode()
        .unwrap_or_default()
}

fn changes_record(offset: i64, changes: Vec<DescChange>) -> Vec<u8> {
    let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
    let entries = changes.into_iter().enumerate().map(|(i, c)| (Stamp { offset, index: i as u32 }, c)).collect();
    ShardMessage::DescChanges { source, entries }.encode().unwrap_or_default()
}

/// Every entity's descendants, recomputed from scratch.
fn recompute_all(graph: &Graph, entities: &[String]) -> usize {
    entities.iter().map(|e| graph.descendants(e).len()).sum()
}

pub fn run(options: &GraphBenchOptions, dir: &Path) -> Result<GraphBenchReport> {
    let now = tally_shared::kafka::now_ms();
    let answers: Vec<String> = (0..options.ancestors).map(|i| format!("answer:{i}")).collect();
    let mut graph = Graph::default();
    let setup: Vec<EdgeUpdate> = answers
        .iter()
        .map(|a| EdgeUpdate { op: EdgeOp::Add, from: a.clone(), to: "user:u".into() })
        .chain([EdgeUpdate { op: EdgeOp::Add, from: "user:v".into(), to: "topic:w".into() }])
        .collect();
    let initial = graph.apply_batch(&setup);
    // Bystanders: answers of other users, two levels (answer → user → topic).
    let elsewhere: Vec<EdgeUpdate> = (0..options.bystanders)
        .map(|i| EdgeUpdate { op: EdgeOp::Add, from: format!("other:{i}"), to: format!("user:{}", i / 50) })
        .collect();
    graph.apply_batch(&elsewhere);

    // The baseline: every descendant set before and after, from scratch.
    let mut all: Vec<String> = answers.clone();
    all.extend(["user:u", "user:v", "topic:w"].map(String::from));
    all.extend((0..options.bystanders).map(|i| format!("other:{i}")));
    all.extend((0..options.bystanders.div_ceil(50)).map(|i| format!("user:{i}")));
    let started = Instant::now();
    let before = recompute_all(&graph, &all);
    let mut scratch = graph.clone();
    scratch.add_edge("user:u", "user:v");
    let after = recompute_all(&scratch, &all);
    let recompute_seconds = started.elapsed().as_secs_f64();
    assert!(after > before, "the edge adds descendants");

    let add = [EdgeUpdate { op: EdgeOp::Add, from: "user:u".into(), to: "user:v".into() }];
    let started = Instant::now();
    let changes = graph.apply_batch(&add);
    let incremental_seconds = started.elapsed().as_secs_f64();

    // A shard that owns every origin: each answer has counts and the view → user:u.
    let store =
        ShardStore::open(0, &dir.join("edge-add"), StoreOptions { shards: options.shards, ..Default::default() })?;
    let counted = increments_record(0, answers.iter().cloned(), now);
    let known = changes_record(1, initial);
    store.apply(
        &[
            ShardRecord { offset: 0, payload: &counted, timestamp: None },
            ShardRecord { offset: 1, payload: &known, timestamp: None },
        ],
        now,
        false,
    )?;
    let change_count = changes.len();
    // Stamps continue after the initial changes.
    let moved = changes_record(2, changes);
    let started = Instant::now();
    store.apply(&[ShardRecord { offset: 2, payload: &moved, timestamp: None }], now, false)?;
    let shard_apply_seconds = started.elapsed().as_secs_f64();

    // Increments on leaves with three levels of ancestors vs on leaves without.
    let leaves = options.increments / 10;
    let hierarchical =
        ShardStore::open(0, &dir.join("levels"), StoreOptions { shards: options.shards, ..Default::default() })?;
    let mut levels = Graph::default();
    let chain: Vec<EdgeUpdate> = (0..leaves)
        .flat_map(|i| {
            let (leaf, l1, l2, l3) =
                (format!("leaf:{i}"), format!("l1:{}", i / 10), format!("l2:{}", i / 100), "l3:0".to_string());
            [(leaf, l1.clone()), (l1, l2.clone()), (l2, l3)]
        })
        .map(|(from, to)| EdgeUpdate { op: EdgeOp::Add, from, to })
        .collect();
    let views = changes_record(1, levels.apply_batch(&chain));
    hierarchical.apply(&[ShardRecord { offset: 0, payload: &views, timestamp: None }], now, false)?;
    let flat = ShardStore::open(0, &dir.join("flat"), StoreOptions { shards: options.shards, ..Default::default() })?;
    let batch =
        |offset| increments_record(offset, (0..options.increments).map(|i| format!("leaf:{}", i % leaves)), now);
    let (first, second) = (batch(1), batch(2));
    flat.apply(&[ShardRecord { offset: 1, payload: &first, timestamp: None }], now, false)?;
    hierarchical.apply(&[ShardRecord { offset: 1, payload: &first, timestamp: None }], now, false)?;

    let started = Instant::now();
    flat.apply(&[ShardRecord { offset: 2, payload: &second, timestamp: None }], now, false)?;
    let flat_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let report = hierarchical.apply(&[ShardRecord { offset: 2, payload: &second, timestamp: None }], now, false)?;
    let hierarchy_seconds = started.elapsed().as_secs_f64();

    Ok(GraphBenchReport {
        changes: change_count,
        incremental_seconds,
        recompute_seconds,
        shard_apply_seconds,
        hierarchy_seconds,
        flat_seconds,
        outbox_messages: report.outbox_messages,
    })
}

/// The leaves → mids → tops shape of part 3.
#[derive(Debug, Clone, Copy)]
pub struct LatencyShape {
    pub leaves: usize,
    pub mids: usize,
    pub tops: usize,
    /// Zipf-skewed increments on the leaves before the edge changes.
    pub increments: usize,
    /// Adds and removes measured (the figures are their medians).
    pub repeats: usize,
}

impl Default for LatencyShape {
    fn default() -> Self {
        Self { leaves: 20_000, mids: 200, tops: 20, increments: 200_000, repeats: 21 }
    }
}

/// Part 3's figures, in seconds.
#[derive(Debug, Clone)]
pub struct LatencyReport {
    /// Entities whose descendant sets the edge changes (its ancestor side).
    pub changes: usize,
    pub add_graph_seconds: f64,
    pub add_shard_seconds: f64,
    pub remove_graph_seconds: f64,
    pub remove_shard_seconds: f64,
    /// The first add's shard step: the origins' direct counts are read from RocksDB
    /// (not yet in memory, [`tally_counter::direct`]).
    pub first_add_shard_seconds: f64,
    /// The slowest shard step of all the adds and removes (one of them folds the
    /// descendant views' log, [`tally_counter::views`]).
    pub slowest_shard_seconds: f64,
    /// All-time totals: `top:0` before, the root after the add and after the remove.
    pub top_total: tally_core::keys::Count,
    pub root_after_add: tally_core::keys::Count,
    pub root_after_remove: tally_core::keys::Count,
    /// The increments each leaf got (index: the leaf's number), for a baseline that
    /// computes the same totals (`tally-baseline-differential`).
    pub leaf_counts: Vec<i64>,
    /// The buckets the shard keeps each count in: one per resolution, and all-time.
    pub buckets_per_count: usize,
}

fn all_time_total(store: &ShardStore, entity: &str) -> Result<tally_core::keys::Count> {
    let mut key = Vec::new();
    tally_core::keys::encode_count_key(&mut key, entity, "views", tally_core::keys::ALL_TIME_WIDTH, 0);
    Ok(store.get_counts(&[key])?[0].total)
}

/// Part 3: adds, then removes, `top:0 → root:fresh` (see the module docs).
pub fn edge_latency(shape: LatencyShape, dir: &Path) -> Result<LatencyReport> {
    let now = tally_shared::kafka::now_ms();
    let per_mid = shape.leaves.div_ceil(shape.mids.max(1));
    let per_top = shape.mids.div_ceil(shape.tops.max(1));
    let mut graph = Graph::default();
    let edges: Vec<EdgeUpdate> = (0..shape.leaves)
        .map(|i| (format!("leaf:{i}"), format!("mid:{}", i / per_mid)))
        .chain((0..shape.mids).map(|j| (format!("mid:{j}"), format!("top:{}", j / per_top))))
        .map(|(from, to)| EdgeUpdate { op: EdgeOp::Add, from, to })
        .collect();
    let views = changes_record(0, graph.apply_batch(&edges));
    let store_options = StoreOptions { shards: 1, ..Default::default() };
    let buckets_per_count = store_options.resolutions.iter().count() + 1;
    let store = ShardStore::open(0, &dir.join("latency"), store_options)?;
    store.apply(&[ShardRecord { offset: 0, payload: &views, timestamp: None }], now, false)?;
    // Zipf(1.1) over the leaves, in records of 1 000 increments.
    let zipf = crate::counter_apply::Zipf::new(shape.leaves, 1.1);
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
    let mut leaf_counts = vec![0i64; shape.leaves];
    let records: Vec<Vec<u8>> = (0..shape.increments.div_ceil(1_000))
        .map(|record| {
            let leaves: Vec<String> = (0..1_000)
                .map(|_| {
                    let leaf = zipf.sample(&mut rng);
                    leaf_counts[leaf] += 1;
                    format!("leaf:{leaf}")
                })
                .collect();
            increments_record(record as i64, leaves.into_iter(), now)
        })
        .collect();
    let counted: Vec<ShardRecord<'_>> = records
        .iter()
        .enumerate()
        .map(|(i, payload)| ShardRecord { offset: 1 + i as i64, payload, timestamp: None })
        .collect();
    store.apply(&counted, now, false)?;
    let mut next_offset = 1 + records.len() as i64;
    let mut step = |op: EdgeOp| -> Result<(usize, f64, f64)> {
        let started = Instant::now();
        let changes = graph.apply_batch(&[EdgeUpdate { op, from: "top:0".into(), to: "root:fresh".into() }]);
        let graph_seconds = started.elapsed().as_secs_f64();
        let count = changes.len();
        let started = Instant::now();
        let record = changes_record(next_offset, changes);
        store.apply(&[ShardRecord { offset: next_offset, payload: &record, timestamp: None }], now, false)?;
        next_offset += 1;
        Ok((count, graph_seconds, started.elapsed().as_secs_f64()))
    };
    let top_total = all_time_total(&store, "top:0")?;
    let (changes, mut add_graph_seconds, mut add_shard_seconds) = step(EdgeOp::Add)?;
    let first_add_shard_seconds = add_shard_seconds;
    let root_after_add = all_time_total(&store, "root:fresh")?;
    let (_, mut remove_graph_seconds, mut remove_shard_seconds) = step(EdgeOp::Remove)?;
    let root_after_remove = all_time_total(&store, "root:fresh")?;
    // The median of `repeats` adds and removes.
    let (mut adds, mut removes) = (vec![(add_graph_seconds, add_shard_seconds)], vec![]);
    removes.push((remove_graph_seconds, remove_shard_seconds));
    for _ in 1..shape.repeats.max(1) {
        let (_, graph, shard) = step(EdgeOp::Add)?;
        adds.push((graph, shard));
        let (_, graph, shard) = step(EdgeOp::Remove)?;
        removes.push((graph, shard));
    }
    let slowest_shard_seconds = adds.iter().chain(&removes).map(|(_, shard)| *shard).fold(0.0, f64::max);
    let median = |runs: &mut Vec<(f64, f64)>| {
        runs.sort_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1)));
        runs[runs.len() / 2]
    };
    (add_graph_seconds, add_shard_seconds) = median(&mut adds);
    (remove_graph_seconds, remove_shard_seconds) = median(&mut removes);
    Ok(LatencyReport {
        changes,
        add_graph_seconds,
        add_shard_seconds,
        remove_graph_seconds,
        remove_shard_seconds,
        first_add_shard_seconds,
        slowest_shard_seconds,
        top_total,
        root_after_add,
        root_after_remove,
        leaf_counts,
        buckets_per_count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run: the edge add reaches every ancestor, and the hierarchical batch
    /// writes totals (figures come from `tally-bench graph`, never a timed test).
    #[test]
    fn small_run_changes_every_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        let report =
            run(&GraphBenchOptions { ancestors: 200, bystanders: 1_000, increments: 500, shards: 4 }, dir.path())
                .unwrap();
        assert_eq!(report.changes, 201, "u and its 200 ancestors gain v and w");
        assert!(report.outbox_messages > 0);
    }

    /// The latency shape, small: the edge from a top reaches the top, its mids and
    /// their leaves, and the root's total is their increments once added, none once
    /// removed.
    #[test]
    fn latency_shape_changes_the_whole_ancestor_side() {
        let dir = tempfile::tempdir().unwrap();
        let shape = LatencyShape { leaves: 200, mids: 20, tops: 2, increments: 3_000, repeats: 3 };
        let report = edge_latency(shape, dir.path()).unwrap();
        assert_eq!(report.changes, 1 + 10 + 100, "top:0, its 10 mids, their 100 leaves");
        assert_eq!(report.buckets_per_count, 4, "1m, 1h, 1d and all-time");
        assert_eq!(report.leaf_counts.len(), 200);
        assert_eq!(report.leaf_counts.iter().sum::<i64>(), 3_000, "every increment on a leaf");
        assert!(report.top_total > 0, "the top counts its leaves' increments");
        assert_eq!(
            (report.root_after_add, report.root_after_remove),
            (report.top_total, 0),
            "the root's total is the top's while the edge exists"
        );
    }
}

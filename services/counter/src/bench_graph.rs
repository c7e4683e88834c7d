//! `tally bench graph`: what hierarchy costs, each figure against a baseline run in
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

use std::path::Path;
use std::time::Instant;

use tally_core::graph::{DescChange, EdgeOp, EdgeUpdate, Graph};
use tally_core::wire::{Increment, ShardMessage, Source, Stamp};

use crate::apply::ShardRecord;
use crate::error::Result;
use crate::store::{ShardStore, StoreOptions};

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

fn changes_record(changes: Vec<DescChange>) -> Vec<u8> {
    let source = Source { stream: Source::GRAPH_PROCESSOR, partition: 0 };
    let entries = changes.into_iter().enumerate().map(|(i, c)| (Stamp { offset: 1, index: i as u32 }, c)).collect();
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
    let known = changes_record(initial);
    store.apply(
        &[
            ShardRecord { offset: 0, payload: &counted, timestamp: None },
            ShardRecord { offset: 1, payload: &known, timestamp: None },
        ],
        now,
        false,
    )?;
    let change_count = changes.len();
    let mut moved = changes_record(changes);
    // Stamps continue after the initial changes.
    if let Ok(ShardMessage::DescChanges { source, entries }) = ShardMessage::decode(&moved) {
        let entries = entries.into_iter().map(|(stamp, c)| (Stamp { offset: 2, index: stamp.index }, c)).collect();
        moved = ShardMessage::DescChanges { source, entries }.encode()?;
    }
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
    let views = changes_record(levels.apply_batch(&chain));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run: the edge add reaches every ancestor, and the hierarchical batch
    /// writes totals (figures come from `tally bench graph`, never a timed test).
    #[test]
    fn small_run_changes_every_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        let report =
            run(&GraphBenchOptions { ancestors: 200, bystanders: 1_000, increments: 500, shards: 4 }, dir.path())
                .unwrap();
        assert_eq!(report.changes, 201, "u and its 200 ancestors gain v and w");
        assert!(report.outbox_messages > 0);
    }
}

//! `tally-bench graph-scale`: what tally-graph's one in-memory graph costs as it grows.
//!
//! For each size (edges, smallest first) and each of two shapes it builds the graph
//! service's store through its own apply path (records of graph updates, as the
//! processor applies them), then measures on it:
//! - the resident memory the graph takes per edge: the process's growth while the
//!   store opens and loads every edge into memory (after `malloc_trim`, so nothing
//!   freed counts; RocksDB's block cache is included, as the service holds it; the
//!   visit stamps a batch's traversals keep, 4 bytes per node and thread, are not);
//! - the latency of single edge updates, each a record of its own through the apply
//!   path (the descendant changes computed, the edges and outbox committed): a new
//!   leaf added under a random middle node and removed, and a middle node given a
//!   second parent and losing it again: p50 and p99, the p99 against the first size's;
//! - a snapshot of the store and its restore (download from disk, not the page
//!   cache, and the load into memory);
//! - on the forest, up to `--differential-up-to` edges: an edge that gives a top
//!   node a parent (every entity under it changes its descendants) through tally's
//!   graph step against differential-dataflow computing the same totals, same shape,
//!   same run ([`crate::hierarchy`]).
//!
//! Shapes, edges pointing the way counts flow (child → parent):
//! - *forest*: answers → users → teams, 100 answers per user, 100 users per team;
//! - *dag*: answers → questions → topics, 10 answers per question, each question
//!   under 1 to 3 topics drawn Zipf(1.0) from one per 100 questions: a heavy tail of
//!   topics holding most questions.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tally_core::graph::{EdgeOp, EdgeUpdate};
use tally_core::wire::{GraphMessage, GraphUpdate, Source, Stamp};
use tally_graph::store::{GraphOptions, GraphStore, UpdateRecord, GRAPH};

use crate::counter_apply::Zipf;
use crate::plot::{line_chart, Series};
use crate::restore::lose_and_restore;
use crate::scale::{percentiles, resident_bytes, short};

/// Updates per record while building.
const BUILD_RECORD: usize = 1_000;
/// Leaves per middle node.
const FOREST_LEAVES: usize = 100;
const DAG_LEAVES: usize = 10;
/// Middle nodes per top node.
const FOREST_MIDS: usize = 100;
const DAG_MIDS: usize = 100;

#[derive(clap::Args, Debug, Clone)]
pub struct GraphScaleArgs {
    /// Graph sizes in edges, smallest first: the first is every ratio's baseline
    /// (add 100000000 for the 100 M run).
    #[arg(long, value_delimiter = ',', default_values_t = [100_000usize, 1_000_000, 10_000_000])]
    pub edges: Vec<usize>,
    /// Single updates timed per size and shape (half leaf, half middle; each an add
    /// and its remove).
    #[arg(long, default_value_t = 4_000)]
    pub updates: usize,
    /// Sizes of the forest up to this many edges are also run through
    /// differential-dataflow (it holds the whole closure in memory).
    #[arg(long, default_value_t = 1_000_000)]
    pub differential_up_to: usize,
    /// Where the stores are built (each removed once measured).
    #[arg(long, default_value = "graph-stores")]
    pub dir: PathBuf,
    /// Where the charts are written.
    #[arg(long, default_value = "graph-plots")]
    pub plots: PathBuf,
}

/// A graph's shape: which edges a size has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Forest,
    Dag,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Forest => "forest",
            Shape::Dag => "dag",
        }
    }

    /// (leaves, middle nodes, top nodes) of a graph of about `edges` edges.
    fn counts(self, edges: usize) -> (usize, usize, usize) {
        match self {
            // Every leaf and every middle node has one parent.
            Shape::Forest => {
                let mids = edges.div_ceil(FOREST_LEAVES + 1).max(1);
                (edges - mids, mids, mids.div_ceil(FOREST_MIDS))
            }
            // A middle node has two parents drawn, fewer once repeats are dropped.
            Shape::Dag => {
                let mids = edges.div_ceil(DAG_LEAVES + 2).max(1);
                (edges.saturating_sub(2 * mids), mids, mids.div_ceil(DAG_MIDS))
            }
        }
    }

    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Shape::Forest => ("answer", "user", "team"),
            Shape::Dag => ("answer", "question", "topic"),
        }
    }

    /// Every edge of a graph of about `edges` edges, middle nodes' first (child,
    /// parent); deterministic.
    pub fn edges(self, edges: usize) -> Vec<(String, String)> {
        let (leaves, mids, tops) = self.counts(edges);
        let (leaf, mid, top) = self.names();
        let mut all = Vec::with_capacity(edges);
        let mut rng = StdRng::seed_from_u64(edges as u64);
        let zipf = Zipf::new(tops, 1.0);
        for m in 0..mids {
            match self {
                Shape::Forest => all.push((format!("{mid}:{m}"), format!("{top}:{}", m / FOREST_MIDS))),
                Shape::Dag => {
                    let mut parents: Vec<usize> = (0..rng.random_range(1..=3)).map(|_| zipf.sample(&mut rng)).collect();
                    parents.sort_unstable();
                    parents.dedup();
                    all.extend(parents.into_iter().map(|t| (format!("{mid}:{m}"), format!("{top}:{t}"))));
                }
            }
        }
        all.extend((0..leaves).map(|l| (format!("{leaf}:{l}"), format!("{mid}:{}", l % mids))));
        all
    }
}

/// The figures of one size and shape.
#[derive(Debug, Clone, Default)]
pub struct GraphFigures {
    /// The size asked for, and the edges its shape has (the DAG's, within 5 %).
    pub size: usize,
    pub edges: usize,
    /// Edges per second built through the apply path.
    pub build_rate: f64,
    /// Resident bytes per edge of the loaded graph.
    pub rss_per_edge: Option<f64>,
    /// Single updates through the apply path: p50 and p99 in µs.
    pub update: (f64, f64),
    pub snapshot_bytes: u64,
    pub snapshot_seconds: f64,
    pub restore_seconds: f64,
    /// A top node given a parent: tally's graph step and differential-dataflow's
    /// update, medians in ms (the forest, up to `--differential-up-to`).
    pub versus_differential: Option<(f64, f64)>,
}

fn options() -> GraphOptions {
    let config = tally_shared::config::TallyConfig::default();
    GraphOptions {
        shards: 8,
        dedupe_window_ms: 86_400_000,
        sync_writes: false,
        record_budget: config.kafka.record_budget(),
        max_descendants: config.graph.max_descendants,
        input_topic: "tally.graph".into(),
    }
}

/// Feeds updates to a store as graph-update records, offsets increasing.
struct Feed {
    next: i64,
}

impl Feed {
    /// Applies `updates` as one record; checks each was applied (none refused, none
    /// skipped as a redelivery).
    fn apply(&mut self, store: &GraphStore, updates: &[EdgeUpdate], now: i64) -> anyhow::Result<()> {
        let source = Source { stream: Source::GRAPH, partition: 0 };
        let offset = self.next;
        self.next += 1;
        let entries = updates
            .iter()
            .enumerate()
            .map(|(index, edge)| (Stamp { offset, index: index as u32 }, GraphUpdate { edge: edge.clone(), id: None }))
            .collect();
        let payload = GraphMessage::Updates { source, entries }.encode()?;
        let report = store.apply(&[UpdateRecord { offset, payload: &payload, timestamp: None }], now)?;
        anyhow::ensure!(
            report.updates == updates.len() as u64 && report.refused == 0 && report.undecodable.is_none(),
            "updates not applied whole: {report:?}"
        );
        Ok(())
    }
}

fn add(from: &str, to: &str) -> EdgeUpdate {
    EdgeUpdate { op: EdgeOp::Add, from: from.into(), to: to.into() }
}

/// Builds `shape`'s `edges` in `store` through the apply path; the build rate.
fn build(
    store: &GraphStore,
    feed: &mut Feed,
    shape: Shape,
    edges: &[(String, String)],
    now: i64,
) -> anyhow::Result<f64> {
    let bar = crate::pipeline::bar(edges.len() as u64, &format!("{} {}", shape.name(), short(edges.len())));
    let mut applying = Duration::ZERO;
    for chunk in edges.chunks(BUILD_RECORD) {
        let updates: Vec<EdgeUpdate> = chunk.iter().map(|(from, to)| add(from, to)).collect();
        let started = Instant::now();
        feed.apply(store, &updates, now)?;
        applying += started.elapsed();
        // The counters would take these; nobody relays them here.
        store.delete_outbox(&store.outbox()?)?;
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    Ok(edges.len() as f64 / applying.as_secs_f64().max(f64::MIN_POSITIVE))
}

/// Times `updates` single updates and the removes that undo them (`2 × updates`
/// records): a new leaf under a random middle node, and a random middle node under
/// a second top node.
fn time_updates(
    store: &GraphStore,
    feed: &mut Feed,
    shape: Shape,
    edges: usize,
    updates: usize,
    now: i64,
) -> anyhow::Result<Vec<Duration>> {
    let (_, mids, tops) = shape.counts(edges);
    let (_, mid, top) = shape.names();
    let mut rng = StdRng::seed_from_u64(41);
    let mut took = Vec::with_capacity(updates * 2);
    for index in 0..updates {
        let edge = match index % 2 {
            0 => add(&format!("new:{index}"), &format!("{mid}:{}", rng.random_range(0..mids))),
            // A top node the middle one is not under yet (the remove then leaves the
            // graph as built): a random one, else one past the last.
            _ => {
                let from = format!("{mid}:{}", rng.random_range(0..mids));
                let graph = tally_shared::lock::read(&store.graph, GRAPH);
                let to = (0..8)
                    .map(|_| format!("{top}:{}", rng.random_range(0..tops)))
                    .find(|to| !graph.has_edge(&from, to))
                    .unwrap_or_else(|| format!("{top}:{tops}"));
                add(&from, &to)
            }
        };
        for op in [EdgeOp::Add, EdgeOp::Remove] {
            let update = EdgeUpdate { op, ..edge.clone() };
            let started = Instant::now();
            feed.apply(store, &[update], now)?;
            took.push(started.elapsed());
        }
        store.delete_outbox(&store.outbox()?)?;
    }
    Ok(took)
}

/// Builds and measures one size of `shape` in `dir`.
fn measure(
    args: &GraphScaleArgs,
    shape: Shape,
    edges: usize,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<GraphFigures> {
    let dir = &args.dir;
    let path = dir.join(format!("{}-{edges}", shape.name()));
    if path.exists() {
        std::fs::remove_dir_all(&path)?; // a store left by an interrupted run
    }
    let now = tally_shared::kafka::now_ms();
    let all = shape.edges(edges);
    let mut figures = GraphFigures { size: edges, edges: all.len(), ..Default::default() };
    let mut feed = Feed { next: 0 };
    let store = GraphStore::open(&path, options())?;
    figures.build_rate = build(&store, &mut feed, shape, &all, now)?;
    drop(all);
    drop(store);

    // The graph loaded into memory, as the service does when it starts.
    let before = resident_bytes();
    let store = GraphStore::open(&path, options())?;
    let loaded = tally_shared::lock::read(&store.graph, GRAPH).edge_count();
    anyhow::ensure!(loaded == figures.edges, "{loaded} edges loaded of {}", figures.edges);
    figures.rss_per_edge =
        before.zip(resident_bytes()).map(|(before, after)| after.saturating_sub(before) as f64 / loaded as f64);
    figures.update = percentiles(time_updates(&store, &mut feed, shape, edges, args.updates / 2, now)?);

    let edges_built = figures.edges;
    let trip = lose_and_restore(
        store,
        GraphStore::store,
        &path,
        (&format!("graph-scale/{}-{edges}", shape.name()), dir),
        runtime,
        |restored| Ok(GraphStore::open(restored, options())?),
        |store| {
            let loaded = tally_shared::lock::read(&store.graph, GRAPH).edge_count();
            anyhow::ensure!(loaded == edges_built, "{loaded} edges restored of {edges_built}");
            Ok(())
        },
    )?;
    figures.snapshot_seconds = trip.snapshot_seconds;
    figures.snapshot_bytes = trip.snapshot_bytes;
    figures.restore_seconds = trip.restore_seconds;

    if shape == Shape::Forest && edges <= args.differential_up_to {
        let (leaves, mids, tops) = shape.counts(edges);
        let latency = crate::counter_graph::LatencyShape { leaves, mids, tops, increments: 100_000, repeats: 5 };
        let scratch = dir.join("differential");
        std::fs::create_dir_all(&scratch)?;
        let (ours, theirs) = crate::hierarchy::edge_latency_against_differential(latency, &scratch)?;
        figures.versus_differential = Some((ours.add_graph_seconds * 1e3, theirs.add_seconds * 1e3));
        std::fs::remove_dir_all(&scratch)?;
    }
    Ok(figures)
}

/// Measures every size of both shapes, smallest first, in `args.dir`.
pub fn run(args: &GraphScaleArgs, runtime: tokio::runtime::Handle) -> anyhow::Result<Vec<(Shape, Vec<GraphFigures>)>> {
    anyhow::ensure!(!args.edges.is_empty() && args.edges[0] > 0 && args.updates >= 2, "nothing to measure");
    anyhow::ensure!(args.edges.windows(2).all(|w| w[0] < w[1]), "--edges: smallest first");
    std::fs::create_dir_all(&args.dir)?;
    let mut shapes = Vec::new();
    for shape in [Shape::Forest, Shape::Dag] {
        let mut sizes: Vec<GraphFigures> = Vec::new();
        for &edges in &args.edges {
            let size = measure(args, shape, edges, &runtime)?;
            println!("{}", row(shape, &size, sizes.first().unwrap_or(&size)));
            sizes.push(size);
        }
        shapes.push((shape, sizes));
    }
    Ok(shapes)
}

/// The table's header.
pub const HEADER: &str = "| shape | edges | build edges/s | RSS B/edge | update p50/p99 µs (p99 × first) | \
snapshot s (MB) | restore s | top node's parent added: tally / differential ms |\n\
|---|---|---|---|---|---|---|---|";

/// One size's row, its p99 against `first`'s.
pub fn row(shape: Shape, size: &GraphFigures, first: &GraphFigures) -> String {
    format!(
        "| {} | {} | {:.0} | {} | {:.0}/{:.0} ({:.2}) | {:.2} ({:.0}) | {:.1} | {} |",
        shape.name(),
        short(size.size),
        size.build_rate,
        size.rss_per_edge.map_or("-".into(), |b| format!("{b:.0}")),
        size.update.0,
        size.update.1,
        size.update.1 / first.update.1.max(f64::MIN_POSITIVE),
        size.snapshot_seconds,
        size.snapshot_bytes as f64 / 1e6,
        size.restore_seconds,
        size.versus_differential.map_or("-".into(), |(ours, theirs)| format!("{ours:.1} / {theirs:.1}")),
    )
}

/// The charts, as (file name, SVG): resident bytes per edge and update p99 by size.
pub fn charts(shapes: &[(Shape, Vec<GraphFigures>)]) -> Vec<(&'static str, String)> {
    let Some((_, first)) = shapes.first() else { return Vec::new() };
    let xs: Vec<f64> = first.iter().map(|f| f.size as f64).collect();
    let curves = |y: &dyn Fn(&GraphFigures) -> Option<f64>| -> Vec<Series> {
        shapes
            .iter()
            .map(|(shape, sizes)| Series { name: shape.name().into(), ys: sizes.iter().map(y).collect() })
            .collect()
    };
    vec![
        (
            "graph-memory.svg",
            line_chart("Resident memory per edge", "edges", "bytes", &xs, &curves(&|f| f.rss_per_edge)),
        ),
        (
            "graph-updates.svg",
            line_chart("Single edge update p99", "edges", "ms", &xs, &curves(&|f| Some(f.update.1 / 1e3))),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// Everything `child` reaches, by brute force over `parents`.
    fn reach(parents: &BTreeMap<&str, Vec<&str>>, child: &str) -> Vec<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![child];
        while let Some(node) = stack.pop() {
            for &parent in parents.get(node).into_iter().flatten() {
                if seen.insert(parent) {
                    stack.push(parent);
                }
            }
        }
        seen.into_iter().map(str::to_string).collect()
    }

    /// A small run measures both shapes (its restores hold every edge built); and a
    /// graph built, updated by the timed updates and reopened holds exactly the
    /// built edges: every entity's descendants equal brute-force reachability.
    #[test]
    fn a_small_run_restores_each_shape_exactly_and_measures_it() {
        let dir = tempfile::tempdir().unwrap();
        let args = GraphScaleArgs {
            edges: vec![3_000, 6_000],
            updates: 40,
            differential_up_to: 3_000,
            dir: dir.path().join("stores"),
            plots: dir.path().join("plots"),
        };
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let shapes = run(&args, runtime.handle().clone()).unwrap();
        assert_eq!(shapes.iter().map(|(shape, _)| *shape).collect::<Vec<_>>(), [Shape::Forest, Shape::Dag]);
        for (shape, sizes) in &shapes {
            for size in sizes {
                assert!(
                    size.build_rate > 0.0 && size.update.1 >= size.update.0 && size.restore_seconds > 0.0,
                    "{size:?}"
                );
                let expect_differential = *shape == Shape::Forest && size.edges <= 3_000;
                assert_eq!(size.versus_differential.is_some(), expect_differential, "{shape:?} {size:?}");
            }
        }
        assert_eq!(charts(&shapes).len(), 2);

        for shape in [Shape::Forest, Shape::Dag] {
            let edges = shape.edges(2_000);
            let path = dir.path().join(shape.name());
            let store = GraphStore::open(&path, options()).unwrap();
            let mut feed = Feed { next: 0 };
            build(&store, &mut feed, shape, &edges, 0).unwrap();
            time_updates(&store, &mut feed, shape, 2_000, 20, 0).unwrap();
            drop(store);
            let store = GraphStore::open(&path, options()).unwrap();
            let graph = tally_shared::lock::read(&store.graph, GRAPH);
            let mut parents: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (child, parent) in &edges {
                parents.entry(child).or_default().push(parent);
            }
            assert_eq!(graph.edge_count(), edges.len(), "{shape:?}");
            for child in parents.keys() {
                assert_eq!(graph.descendants(child), reach(&parents, child), "{shape:?} {child}");
            }
        }
    }

    #[test]
    fn each_shape_has_the_edges_asked_for_within_a_node() {
        for shape in [Shape::Forest, Shape::Dag] {
            for edges in [12_000, 120_000] {
                let all = shape.edges(edges);
                let distinct: BTreeSet<_> = all.iter().collect();
                assert_eq!(distinct.len(), all.len(), "{shape:?}: an edge twice");
                // The DAG draws 1-3 parents per middle node: two on average.
                let slack = if shape == Shape::Dag { edges / 20 } else { 1 };
                assert!(all.len().abs_diff(edges) <= slack, "{shape:?} {edges}: {}", all.len());
            }
        }
    }
}

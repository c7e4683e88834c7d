//! `tally-bench graph`'s command: the counter's hierarchy benchmarks
//! ([`crate::counter_graph`]), and the latency shape's edge updates against
//! differential-dataflow computing the same totals in the same run
//! ([`crate::differential`]).

use std::path::Path;

use crate::counter_graph::{edge_latency, GraphBenchOptions, LatencyReport, LatencyShape};
use crate::differential;

/// tally's edge updates on `shape`, then differential-dataflow's on the same graph
/// and the same counts, each in as many buckets as the shard keeps it in. An error when the two disagree on the root's totals: the
/// baseline would be computing something else.
pub fn edge_latency_against_differential(
    shape: LatencyShape,
    dir: &Path,
) -> anyhow::Result<(LatencyReport, differential::Report)> {
    let latency = edge_latency(shape, dir)?;
    let baseline = differential::edge_latency(&differential::Shape {
        mids: shape.mids as u32,
        tops: shape.tops as u32,
        leaf_counts: latency.leaf_counts.clone(),
        buckets: latency.buckets_per_count as u8,
        repeats: shape.repeats,
    });
    let (ours, theirs) = (
        (latency.root_after_add, latency.root_after_remove),
        (baseline.root_after_add.into(), baseline.root_after_remove.into()),
    );
    anyhow::ensure!(
        ours == theirs,
        "differential-dataflow's root totals after the add and the remove {theirs:?} differ from tally's {ours:?}"
    );
    Ok((latency, baseline))
}

/// Runs `tally-bench graph` and prints its figures with their baselines.
pub async fn run(options: GraphBenchOptions, repeats: usize) -> anyhow::Result<()> {
    println!(
        "graph bench: an edge add with {} ancestors in a graph with {} other edges; {} increments on leaves with 3 levels of ancestors; {} shards; RocksDB on disk",
        options.ancestors, options.bystanders, options.increments, options.shards
    );
    let dir = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
    let path = dir.path().to_path_buf();
    let shape = LatencyShape { repeats, ..Default::default() };
    let (r, (latency, differential)) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        Ok((crate::counter_graph::run(&options, &path)?, edge_latency_against_differential(shape, &path)?))
    })
    .await??;
    let ms = |s: f64| s * 1_000.0;
    println!("edge add, graph processor : {:>9.2} ms for {} descendant changes", ms(r.incremental_seconds), r.changes);
    println!(
        "  recompute-everything baseline: {:>9.2} ms  ratio {:.1}x",
        ms(r.recompute_seconds),
        r.recompute_seconds / r.incremental_seconds.max(1e-9)
    );
    println!(
        "edge add, counter shard   : {:>9.2} ms to apply them ({:.0} changes/s)",
        ms(r.shard_apply_seconds),
        r.changes as f64 / r.shard_apply_seconds.max(1e-9)
    );
    println!(
        "increments, 3 levels up   : {:>9.2} ms  ({} outbox messages for other shards)",
        ms(r.hierarchy_seconds),
        r.outbox_messages
    );
    println!(
        "  same batch, no ancestors: {:>9.2} ms  hierarchy costs {:.1}x",
        ms(r.flat_seconds),
        r.hierarchy_seconds / r.flat_seconds.max(1e-9)
    );
    let l = latency;
    println!(
        "edge latency, {} leaves → {} mids → {} tops, {} Zipf increments; top:0 → a fresh root ({} ancestors-side entities), in process, one shard, median of {}:",
        shape.leaves, shape.mids, shape.tops, shape.increments, l.changes, shape.repeats
    );
    println!(
        "  add   : graph {:>6.2} ms + shard {:>6.2} ms = {:>6.2} ms (root total {} = top:0's {})",
        ms(l.add_graph_seconds),
        ms(l.add_shard_seconds),
        ms(l.add_graph_seconds + l.add_shard_seconds),
        l.root_after_add,
        l.top_total
    );
    println!(
        "  remove: graph {:>6.2} ms + shard {:>6.2} ms = {:>6.2} ms (root total {})",
        ms(l.remove_graph_seconds),
        ms(l.remove_shard_seconds),
        ms(l.remove_graph_seconds + l.remove_shard_seconds),
        l.root_after_remove
    );
    println!(
        "  shard step of the first add (origins' counts read from RocksDB, not yet in memory): {:>6.2} ms; slowest of all: {:>6.2} ms",
        ms(l.first_add_shard_seconds),
        ms(l.slowest_shard_seconds)
    );
    let d = differential;
    println!(
        "  differential-dataflow, same shape and counts, one worker, in memory (same totals): add {:>6.2} ms, remove {:>6.2} ms",
        ms(d.add_seconds),
        ms(d.remove_seconds)
    );
    println!(
        "  tally / differential-dataflow: add {:.2}x, remove {:.2}x",
        (l.add_graph_seconds + l.add_shard_seconds) / d.add_seconds.max(1e-9),
        (l.remove_graph_seconds + l.remove_shard_seconds) / d.remove_seconds.max(1e-9)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small shape: both compute the top's total for the root, then 0.
    #[test]
    fn differential_dataflow_computes_the_same_root_totals() {
        let dir = tempfile::tempdir().unwrap();
        let shape = LatencyShape { leaves: 300, mids: 30, tops: 3, increments: 4_000, repeats: 3 };
        let (ours, theirs) = edge_latency_against_differential(shape, dir.path()).unwrap();
        assert!(ours.top_total > 0);
        assert_eq!(
            (
                ours.root_after_add,
                ours.root_after_remove,
                theirs.root_after_add.into(),
                theirs.root_after_remove.into()
            ),
            (ours.top_total, 0, ours.top_total, 0i128)
        );
    }
}

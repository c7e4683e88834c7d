//! `tally-bench`: tally's benchmarks. Each starts what it measures (the local broker
//! and the service binaries built next to it, or the counter's store in process),
//! measures a baseline in the same run and prints the figures with their ratio;
//! BENCHMARKS.md keeps the current ones with the commands that reproduce them.

pub mod counter_apply;
pub mod counter_graph;
pub mod cpu;
pub mod differential;
pub mod failover;
pub mod freshness;
pub mod graph_scale;
pub mod hierarchy;
pub mod jobs;
pub mod parse;
pub mod pipeline;
pub mod plot;
pub mod read_phase;
pub mod restore;
pub mod scale;
pub mod segments;
pub mod shapes;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tally_shared::config::TallyConfig;

#[derive(Parser)]
#[command(
    name = "tally-bench",
    version,
    about = "tally's benchmarks, each against a baseline measured in the same run"
)]
struct Cli {
    /// The TOML config (also $TALLY_CONFIG); TALLY__SECTION__KEY variables override it.
    #[arg(long, short, global = true, env = "TALLY_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// End to end: increments/s from a backlog through the ingester and a counter vs the raw consume rate.
    Ingest(pipeline::IngestBenchArgs),
    /// Read latency through tally-query (p50/p99/p999), idle and while ingesting.
    Read(pipeline::ReadBenchArgs),
    /// How soon a read shows an increment after it was sent, idle and under steady loads.
    Freshness(freshness::FreshnessBenchArgs),
    /// Three counters under a steady load, one killed with -9: time until every shard it
    /// owned answers a fresh read again, with a standby per shard and without.
    Failover(failover::FailoverBenchArgs),
    /// A dequeue broker: dequeue latency, dequeue → ack round trips and jobs/s vs the raw consume rate.
    Jobs(jobs::JobsBenchArgs),
    Scale(scale::ScaleBenchArgs),
    /// The graph service at 100 k to 100 M edges in two shapes: resident bytes per edge,
    /// single-update latency, snapshot and restore, an update against differential-dataflow.
    GraphScale(graph_scale::GraphScaleArgs),
    /// What hierarchy costs: an edge add with many ancestors, increments with three levels of ancestors.
    Graph {
        #[arg(long, default_value_t = 10_000)]
        ancestors: usize,
        /// Unaffected edges elsewhere in the graph.
        #[arg(long, default_value_t = 100_000)]
        bystanders: usize,
        #[arg(long, default_value_t = 10_000)]
        increments: usize,
        #[arg(long, default_value_t = 8)]
        shards: u32,
        /// Edge adds and removes timed in the latency shape (medians printed).
        #[arg(long, default_value_t = 21)]
        repeats: usize,
    },
    /// Time for a shard that lost its disk to serve again: restored from a snapshot
    /// (and the log after it) vs replaying its whole log, at several history sizes.
    Restore {
        /// Increments of history before the snapshot, comma-separated; one run each.
        #[arg(long, value_delimiter = ',', default_values_t = [1_000_000usize, 10_000_000])]
        history: Vec<usize>,
        /// Increments after the snapshot (the tail a restore replays).
        #[arg(long, default_value_t = 100_000)]
        tail: usize,
        /// Entities the increments spread over.
        #[arg(long, default_value_t = 100_000)]
        entities: usize,
        /// Zipf exponent of their popularity (0: uniform, every entity alike).
        #[arg(long, default_value_t = 1.1)]
        zipf: f64,
    },
    /// The ingester's parse on one thread: arrays of valid increments (one pass) vs the
    /// same with an element to reject (element by element); with `--per-message 1`,
    /// single objects read by the scanner vs serde_json.
    Parse {
        #[arg(long, default_value_t = 20_000)]
        messages: usize,
        #[arg(long, default_value_t = 100)]
        per_message: usize,
        /// Rounds of each way, alternating; the best of each counts.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
    },
    /// Segmented counters in process: parse and apply of segmented increments vs plain
    /// ones, a breakdown by state vs one filtered read per state, bytes per combination.
    Segments {
        #[arg(long, default_value_t = 1_000_000)]
        increments: usize,
        #[arg(long, default_value_t = 10_000)]
        entities: usize,
        /// Breakdowns timed, each against its 50 filtered reads.
        #[arg(long, default_value_t = 300)]
        reads: usize,
    },
    /// The counter apply path vs a per-event, no-coalescing baseline.
    Counter {
        #[arg(long, default_value_t = 5_000_000)]
        increments: usize,
        #[arg(long, default_value_t = 200_000)]
        baseline_increments: usize,
        #[arg(long, default_value_t = 100_000)]
        entities: usize,
        /// Spread of event times before now, in ms (10 s: a live stream; 3600000: an hour of backfill).
        #[arg(long, default_value_t = 10_000)]
        event_spread_ms: i64,
        /// Payload bytes per applied batch (default: `counter.batch_max_bytes` of the config).
        #[arg(long)]
        batch_max_bytes: Option<usize>,
    },
}

/// The name of every benchmark (`tally-bench <name>`).
pub fn benchmarks() -> Vec<String> {
    use clap::CommandFactory;
    Cli::command()
        .get_subcommands()
        .map(|command| command.get_name().to_string())
        .filter(|name| name != "help")
        .collect()
}

/// Whether `args` (the words after `tally-bench`) is a command line it accepts; the
/// parser's message when not.
pub fn check_command_line(args: &[String]) -> Result<(), String> {
    let words = std::iter::once("tally-bench".to_string()).chain(args.iter().cloned());
    match Cli::try_parse_from(words) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == clap::error::ErrorKind::DisplayHelp => Ok(()),
        Err(err) => Err(err.to_string()),
    }
}

pub fn main() -> ExitCode {
    tally_shared::service::command_main("tally-bench", dispatch(Cli::parse()))
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let config = TallyConfig::load(cli.config.as_deref())?;
    println!("RocksDB: {}", rocksdb_build());
    match cli.command {
        Command::Counter { increments, baseline_increments, entities, event_spread_ms, batch_max_bytes } => {
            let options = counter_apply::BenchOptions {
                increments,
                baseline_increments,
                entities,
                event_spread_ms,
                batch_max_bytes: batch_max_bytes.unwrap_or(config.counter.batch_max_bytes),
                ..Default::default()
            };
            bench_counter(options).await
        }
        Command::Ingest(args) => pipeline::ingest(config, args).await,
        Command::Read(args) => pipeline::read(config, args).await,
        Command::Freshness(args) => freshness::run(config, args).await,
        Command::Failover(args) => failover::run(config, args).await,
        Command::Jobs(args) => jobs::run(config, args).await,
        Command::Scale(args) => bench_scale(args).await,
        Command::GraphScale(args) => bench_graph_scale(args).await,
        Command::Parse { messages, per_message, rounds } => {
            println!("parse bench: {messages} messages of {per_message} increments (Zipf entities), {rounds} rounds each way, one thread");
            let figures = tokio::task::spawn_blocking(move || parse::run(messages, per_message, rounds)).await??;
            println!("one pass (every element valid): {:>12.0} increments per CPU-second", figures.one_pass);
            println!("{}: {:>8.0} increments per CPU-second", figures.baseline, figures.element_by_element);
            println!("ratio: {:.2}x", figures.one_pass / figures.element_by_element);
            Ok(())
        }
        Command::Restore { history, tail, entities, zipf } => bench_restore(history, tail, entities, zipf).await,
        Command::Segments { increments, entities, reads } => {
            bench_segments(segments::SegmentBenchOptions { increments, entities, reads }).await
        }
        Command::Graph { ancestors, bystanders, increments, shards, repeats } => {
            let options = counter_graph::GraphBenchOptions { ancestors, bystanders, increments, shards };
            hierarchy::run(options, repeats).await
        }
    }
}

/// Which RocksDB this build runs on: Debian's shared library (what debug builds link,
/// `.cargo/config.toml`) is built with its assertions on and runs the counter's hot
/// paths at up to half the speed of one compiled from source, so a benchmark says so.
/// It looks at this process; the services a benchmark starts come from the same build.
fn rocksdb_build() -> &'static str {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) if maps.contains("librocksdb.so") => {
            "Debian's shared library (built with assertions: counter figures up to 2x slower than BENCHMARKS.md's; build with ROCKSDB_COMPILE=1)"
        }
        Ok(_) => "compiled in from source (ROCKSDB_COMPILE=1)",
        Err(_) => "unknown (/proc/self/maps unreadable)",
    }
}

async fn bench_graph_scale(args: graph_scale::GraphScaleArgs) -> anyhow::Result<()> {
    println!(
        "graph-scale bench: graphs of {:?} edges, forest and dag, built through the graph service's apply path; \
         {} single updates timed per size; differential-dataflow up to {} edges; RocksDB on disk in {}",
        args.edges,
        args.updates,
        args.differential_up_to,
        args.dir.display()
    );
    let runtime = tokio::runtime::Handle::current();
    let run_args = args.clone();
    let shapes = tokio::task::spawn_blocking(move || graph_scale::run(&run_args, runtime)).await??;
    println!("\n{}", graph_scale::HEADER);
    for (shape, sizes) in &shapes {
        for size in sizes {
            println!("{}", graph_scale::row(*shape, size, &sizes[0]));
        }
    }
    write_charts(&args.plots, graph_scale::charts(&shapes))
}

/// Writes each (file name, SVG) into `dir`.
fn write_charts(dir: &std::path::Path, charts: Vec<(&'static str, String)>) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, svg) in charts {
        let path = dir.join(name);
        std::fs::write(&path, svg)?;
        println!("chart: {}", path.display());
    }
    Ok(())
}

async fn bench_scale(args: scale::ScaleBenchArgs) -> anyhow::Result<()> {
    println!(
        "scale bench: stores of {:?} entities x {} metrics, {} increments per counter built through the counter's apply path; \
         live streams of {} increments; {} point reads per phase; RocksDB on disk in {}",
        args.entities,
        args.metrics,
        args.per_counter,
        args.live,
        args.reads,
        args.dir.display()
    );
    let runtime = tokio::runtime::Handle::current();
    let run_args = args.clone();
    let figures = tokio::task::spawn_blocking(move || scale::run(&run_args, runtime)).await??;
    println!("\n{}", scale::HEADER);
    for size in &figures {
        println!("{}", scale::row(size, &figures[0]));
    }
    write_charts(&args.plots, scale::charts(&figures))
}

async fn bench_restore(histories: Vec<usize>, tail: usize, entities: usize, zipf: f64) -> anyhow::Result<()> {
    let workload = counter_apply::BenchOptions { entities, zipf_exponent: zipf, ..Default::default() };
    println!(
        "restore bench: one shard's log of {histories:?} increments of history and {tail} after the snapshot, {} entities, Zipf s={}, {} increments/record; RocksDB and the snapshot store (a local directory) on disk",
        workload.entities, workload.zipf_exponent, workload.increments_per_record
    );
    let options = restore::RestoreBenchOptions { histories, tail, workload };
    let dir = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
    let path = dir.path().to_path_buf();
    let runtime = tokio::runtime::Handle::current();
    let figures = tokio::task::spawn_blocking(move || restore::run(&options, &path, runtime)).await??;
    for f in figures {
        println!(
            "history {:>10}: replay {:>7.2} s   restore {:>6.2} s (download {:.2} s of a {:.1} MB snapshot, tail replayed)   {:.1}x",
            f.history,
            f.replay_seconds,
            f.restore_seconds,
            f.download_seconds,
            f.snapshot_bytes as f64 / 1e6,
            f.ratio()
        );
        let held = f.download_rss_bytes.map_or("unknown".into(), |bytes| format!("{:.1} MB", bytes as f64 / 1e6));
        println!(
            "                    memory held by the download (peak resident growth): {held}; the largest file: {:.1} MB",
            f.largest_file_bytes as f64 / 1e6
        );
    }
    Ok(())
}

async fn bench_segments(options: segments::SegmentBenchOptions) -> anyhow::Result<()> {
    println!(
        "segments bench: {} events over {} entities (Zipf s=1.1), each with a state of {} and a device of 5 (Zipf, uniform): plain (no segments), segmented, and named (segments faked with entity names: each event also counted on an entity named after its segments); one thread; RocksDB on disk",
        options.increments, options.entities, segments::STATES
    );
    let dir = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
    let path = dir.path().to_path_buf();
    let f = tokio::task::spawn_blocking(move || segments::run(&options, &path)).await??;
    for (step, (plain, segmented, named)) in [("parse", f.parse), ("apply", f.apply)] {
        println!(
            "{step} : {plain:>10.0} plain, {segmented:>10.0} segmented, {named:>10.0} named events per CPU-second: segmented costs {:.2}x plain, {:.2}x named",
            plain / segmented.max(f64::MIN_POSITIVE),
            named / segmented.max(f64::MIN_POSITIVE)
        );
    }
    let q = segments::quantile;
    println!(
        "breakdown by state ({:.0} groups on average): p50 {:.0} µs, p99 {:.0} µs; {} filtered reads: p50 {:.0} µs, p99 {:.0} µs: {:.1}x faster at p50",
        f.groups,
        q(&f.breakdown_us, 0.5),
        q(&f.breakdown_us, 0.99),
        segments::STATES,
        q(&f.filtered_us, 0.5),
        q(&f.filtered_us, 0.99),
        q(&f.filtered_us, 0.5) / q(&f.breakdown_us, 0.5).max(f64::MIN_POSITIVE)
    );
    let added = f.disk_bytes.1.saturating_sub(f.disk_bytes.0);
    println!(
        "disk  : {} bytes plain, {} segmented (flushed): {:.0} bytes per combination ({} combinations)",
        f.disk_bytes.0,
        f.disk_bytes.1,
        added as f64 / f.combinations.max(1) as f64,
        f.combinations
    );
    Ok(())
}

async fn bench_counter(options: counter_apply::BenchOptions) -> anyhow::Result<()> {
    println!(
        "counter apply bench: {} increments (baseline {}), {} entities, Zipf s={}, {} increments/record, batches of {} bytes, events over the last {} ms, RocksDB on disk",
        options.increments, options.baseline_increments, options.entities, options.zipf_exponent, options.increments_per_record, options.batch_max_bytes, options.event_spread_ms
    );
    let dir = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
    let path = dir.path().to_path_buf();
    let report = tokio::task::spawn_blocking(move || counter_apply::run(&options, &path)).await??;
    println!(
        "coalesced batches : {:>12.0} increments/s ({:.0} increments and {:.0} keys written per batch)",
        report.coalesced_per_sec, report.increments_per_batch, report.keys_per_batch
    );
    println!("  on the apply thread: {:>10.0} increments per CPU-second", report.coalesced_per_cpu_sec);
    println!("per-event baseline: {:>12.0} increments/s", report.baseline_per_sec);
    println!("ratio             : {:>12.1}x", report.ratio());
    Ok(())
}

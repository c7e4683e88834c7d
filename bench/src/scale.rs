//! `tally-bench scale`: how a counter's costs grow as its store outgrows memory.
//!
//! For each size (entities, smallest first) it builds a store through the counter's
//! own apply path — every entity's metrics counted a few times, spread over the
//! retained minute, hour and day buckets, the counters in a scattered order — then
//! measures on it, each figure against a baseline from the same run:
//! - the apply rate of a live Zipf stream and of a uniform one, against the first
//!   size's;
//! - point reads of a count through the store's read path, p50 and p99, warm (Zipf
//!   keys after a warm-up) and cold (uniform keys, block and page cache dropped), and
//!   batches of 100 cold: against a plain RocksDB get (multi-get) of the same keys;
//! - disk bytes per retained count after a full compaction, against the bytes of a
//!   count's value alone, and the write amplification RocksDB reports for the build;
//! - the process's resident memory with the store open and read, and a restore of
//!   the store's snapshot.
//!
//! It prints the table; [`crate::plot`] draws each curve as SVG.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tally_core::format::RECORD_V3;
use tally_core::keys::{encode_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::WindowSpec;
use tally_core::wire::{Increment, Kind, ShardMessage, ShardQuery, Source, Stamp};
use tally_counter::store::{ShardStore, StoreOptions};

use crate::counter_apply::Zipf;
use crate::plot::{line_chart, Series};
use crate::restore::{lose_and_restore, uncache};

/// Counters built per applied chunk.
const CHUNK_COUNTERS: usize = 20_000;
/// Increments per shard record, as an ingester packs them.
const PER_RECORD: usize = 100;
/// Keys per batched read.
const BATCH: usize = 100;
/// A prime above any counter count: counter `c` is built `c * STRIDE mod n`-th.
const STRIDE: u128 = 1_000_000_007;
/// Within the minute buckets' 6 h, an hour to spare for a long build.
const MINUTE_RETAINED_MS: i64 = 5 * 3_600_000;
const HOUR_RETAINED_MS: i64 = 30 * 86_400_000;

#[derive(clap::Args, Debug, Clone)]
pub struct ScaleBenchArgs {
    /// Store sizes in entities, smallest first: the first is every ratio's baseline
    /// (add 100000000 for the 100 M run; it needs about 60 GB of disk).
    #[arg(long, value_delimiter = ',', default_values_t = [100_000usize, 1_000_000, 10_000_000])]
    pub entities: Vec<usize>,
    /// Metrics per entity.
    #[arg(long, default_value_t = 2)]
    pub metrics: usize,
    /// Increments per counter while building: all but one within the minute
    /// buckets' retention, one within the hour buckets'.
    #[arg(long, default_value_t = 4)]
    pub per_counter: usize,
    /// Increments of each live stream (Zipf, uniform).
    #[arg(long, default_value_t = 1_000_000)]
    pub live: usize,
    /// Point reads per phase (and a tenth as many batches of 100, of keys of their own).
    #[arg(long, default_value_t = 20_000)]
    pub reads: usize,
    /// Where the stores are built (each removed once measured).
    #[arg(long, default_value = "scale-stores")]
    pub dir: PathBuf,
    /// Where the charts are written.
    #[arg(long, default_value = "scale-plots")]
    pub plots: PathBuf,
}

/// p50 and p99 of a read path and of the plain gets of the same keys, in µs.
#[derive(Debug, Clone, Default)]
pub struct Latencies {
    pub read: (f64, f64),
    pub get: (f64, f64),
}

/// The figures of one size.
#[derive(Debug, Clone, Default)]
pub struct SizeFigures {
    pub entities: usize,
    /// Retained counts (keys of the counts family) after compaction.
    pub counts: u64,
    pub build_rate: f64,
    pub zipf_rate: f64,
    pub uniform_rate: f64,
    /// Count keys the uniform stream's batches wrote per second: the store's own
    /// rate, whatever a batch's repeats of a counter coalesced.
    pub uniform_keys_rate: f64,
    /// The share of the uniform stream's time its writes stood stalled by RocksDB
    /// (flushes or compactions behind: `Cumulative stall` in its DB stats).
    pub uniform_stalled: Option<f64>,
    pub warm: Latencies,
    pub cold: Latencies,
    /// Cold batches of 100: p99 µs through the read path and of plain multi-gets.
    pub batch_p99: (f64, f64),
    pub bytes_per_count: f64,
    /// The build's write amplification as RocksDB's compaction stats report it.
    pub write_amp: Option<f64>,
    /// How far the process's resident memory rose with the store open and read.
    pub rss_bytes: Option<u64>,
    pub snapshot_bytes: u64,
    pub restore_seconds: f64,
}

/// Feeds increments to a store as shard records, stamps and offsets increasing.
struct Feed {
    next: i64,
    batch_max_bytes: usize,
}

impl Feed {
    fn records(&mut self, increments: Vec<Increment>) -> Vec<Vec<u8>> {
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        let mut increments = increments.into_iter().peekable();
        let mut records = Vec::new();
        while increments.peek().is_some() {
            let offset = self.next;
            self.next += 1;
            let entries: Vec<(Stamp, Increment)> = increments
                .by_ref()
                .take(PER_RECORD)
                .enumerate()
                .map(|(index, increment)| (Stamp { offset, index: index as u32 }, increment))
                .collect();
            records.push(ShardMessage::encode_increments(source, &entries, RECORD_V3).unwrap_or_default());
        }
        records
    }

    /// Applies `records` (the last ones [`Feed::records`] made) as the consumer does;
    /// the count keys its batches wrote.
    fn apply(&self, store: &ShardStore, records: &[Vec<u8>], now: i64) -> anyhow::Result<usize> {
        let first = self.next - records.len() as i64;
        let mut keys = 0;
        // Every record new: none skipped as a redelivery, none refused.
        for report in crate::restore::apply_log(store, records, first, self.batch_max_bytes, now)? {
            anyhow::ensure!(
                report.redelivered == 0 && report.gap.is_none() && report.undecodable.is_none(),
                "records not applied whole: {report:?}"
            );
            keys += report.keys;
        }
        Ok(keys)
    }
}

fn entity(index: usize) -> String {
    format!("answer:{index}")
}

fn metric(index: usize) -> String {
    format!("metric{index}")
}

fn open(path: &Path) -> anyhow::Result<ShardStore> {
    Ok(ShardStore::open(0, path, StoreOptions::default())?)
}

/// Builds `entities` × `metrics` counters of `per_counter` increments each.
fn build(store: &ShardStore, feed: &mut Feed, args: &ScaleBenchArgs, entities: usize, now: i64) -> anyhow::Result<f64> {
    let counters = entities * args.metrics;
    let bar = crate::pipeline::bar((counters * args.per_counter) as u64, &format!("building {}", short(entities)));
    let mut rng = StdRng::seed_from_u64(entities as u64);
    let mut applying = Duration::ZERO;
    for first in (0..counters).step_by(CHUNK_COUNTERS) {
        let mut increments = Vec::with_capacity(CHUNK_COUNTERS * args.per_counter);
        for counter in first..(first + CHUNK_COUNTERS).min(counters) {
            let scattered = (counter as u128 * STRIDE % counters as u128) as usize;
            for index in 0..args.per_counter {
                let spread = if index + 1 < args.per_counter || args.per_counter == 1 {
                    MINUTE_RETAINED_MS
                } else {
                    HOUR_RETAINED_MS
                };
                increments.push(Increment {
                    entity: entity(scattered / args.metrics),
                    metric: metric(scattered % args.metrics),
                    delta: 1,
                    ts: now - rng.random_range(0..spread),
                    id: None,
                });
            }
        }
        let added = increments.len() as u64;
        let records = feed.records(increments);
        let started = Instant::now();
        feed.apply(store, &records, now)?;
        applying += started.elapsed();
        bar.inc(added);
    }
    bar.finish_and_clear();
    Ok((counters * args.per_counter) as f64 / applying.as_secs_f64().max(f64::MIN_POSITIVE))
}

/// What a live stream did: increments and count keys written per second, and the
/// share of its time writes stood stalled.
type LiveRates = (f64, f64, Option<f64>);

/// Applies `live` increments of entities drawn by `draw`, event times within the
/// last 10 s.
fn live_rate(
    store: &ShardStore,
    feed: &mut Feed,
    args: &ScaleBenchArgs,
    mut draw: impl FnMut(&mut StdRng) -> usize,
    now: i64,
) -> anyhow::Result<LiveRates> {
    let mut rng = StdRng::seed_from_u64(17);
    let increments: Vec<Increment> = (0..args.live)
        .map(|_| Increment {
            entity: entity(draw(&mut rng)),
            metric: metric(rng.random_range(0..args.metrics)),
            delta: 1,
            ts: now - rng.random_range(0..10_000),
            id: None,
        })
        .collect();
    let records = feed.records(increments);
    let stalled = || store.rocks().db().property_value("rocksdb.dbstats").ok().flatten().as_deref().and_then(stall);
    let stalled_before = stalled();
    let started = Instant::now();
    let keys = feed.apply(store, &records, now)?;
    let seconds = started.elapsed().as_secs_f64();
    let share = stalled_before.zip(stalled()).map(|(before, after)| (after - before) / seconds);
    Ok((args.live as f64 / seconds, keys as f64 / seconds, share))
}

/// The seconds writes stood stalled since the database opened, from RocksDB's DB
/// stats (`Cumulative stall: 00:00:1.500 H:M:S, 2.5 percent`).
pub fn stall(stats: &str) -> Option<f64> {
    let line = stats.lines().find_map(|line| line.trim_start().strip_prefix("Cumulative stall:"))?;
    let clock = line.split_whitespace().next()?;
    let mut parts = clock.split(':').map(str::parse::<f64>);
    let (hours, minutes, seconds) = (parts.next()?.ok()?, parts.next()?.ok()?, parts.next()?.ok()?);
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}

/// The keys of the counters read: (entity, metric) drawn by `draw`.
fn keys(count: usize, metrics: usize, seed: u64, mut draw: impl FnMut(&mut StdRng) -> usize) -> Vec<(String, String)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count).map(|_| (entity(draw(&mut rng)), metric(rng.random_range(0..metrics)))).collect()
}

fn query((entity, metric): &(String, String)) -> ShardQuery {
    ShardQuery::plain(entity.clone(), metric.clone(), Kind::Total, WindowSpec::All)
}

fn all_time_key((entity, metric): &(String, String)) -> Vec<u8> {
    let mut key = Vec::with_capacity(64);
    encode_count_key(&mut key, entity, metric, ALL_TIME_WIDTH, 0);
    key
}

/// How long each group of `keys` took through the read path (one request each).
fn read_path(store: &ShardStore, groups: &[&[(String, String)]], now: i64) -> anyhow::Result<Vec<Duration>> {
    let mut took = Vec::with_capacity(groups.len());
    for group in groups {
        let queries: Vec<ShardQuery> = group.iter().map(query).collect();
        let started = Instant::now();
        let answers = store.read(&queries, now)?;
        took.push(started.elapsed());
        anyhow::ensure!(answers.len() == queries.len(), "{} answers to {} queries", answers.len(), queries.len());
    }
    Ok(took)
}

/// How long each group of `keys` took as plain gets of their all-time keys.
fn plain_gets(store: &ShardStore, groups: &[&[(String, String)]]) -> anyhow::Result<Vec<Duration>> {
    let db = store.rocks().db();
    let cf = store.counts_family()?;
    let mut took = Vec::with_capacity(groups.len());
    for group in groups {
        let keys: Vec<Vec<u8>> = group.iter().map(all_time_key).collect();
        let started = Instant::now();
        let found = match keys.as_slice() {
            [one] => usize::from(db.get_pinned_cf(cf, one)?.is_some()),
            many => db
                .multi_get_cf(many.iter().map(|key| (cf, key)))
                .into_iter()
                .filter(|got| matches!(got, Ok(Some(_))))
                .count(),
        };
        took.push(started.elapsed());
        anyhow::ensure!(found == keys.len(), "{found} of {} counters found", keys.len());
    }
    Ok(took)
}

/// p50 and p99 in µs.
pub(crate) fn percentiles(mut took: Vec<Duration>) -> (f64, f64) {
    took.sort_unstable();
    let at = |q: f64| took.get(((took.len() as f64 * q) as usize).min(took.len().saturating_sub(1)));
    let micros = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e6);
    (micros(at(0.50)), micros(at(0.99)))
}

/// Closes the store, drops its files from the page cache, opens it again (its
/// block cache empty).
fn reopen_cold(store: ShardStore, path: &Path) -> anyhow::Result<ShardStore> {
    store.persist()?;
    drop(store);
    uncache(path)?;
    open(path)
}

/// Waits (at most ten minutes) until the store's memtables are flushed and RocksDB
/// owes no compaction.
fn settle(store: &ShardStore) -> anyhow::Result<()> {
    store.persist()?;
    let db = store.rocks().db();
    let cf = store.counts_family()?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let owed = |name: &str| db.property_int_value_cf(cf, name).map(|value| value.unwrap_or(0));
    while owed("rocksdb.estimate-pending-compaction-bytes")? > 0 || owed("rocksdb.num-running-compactions")? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "compactions still owed after ten minutes");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// The `W-Amp` of the `Sum` row of RocksDB's compaction stats (`rocksdb.cfstats`).
pub fn write_amp(stats: &str) -> Option<f64> {
    let header = stats.lines().find(|line| line.trim_start().starts_with("Level"))?;
    let column = header.split_whitespace().position(|name| name == "W-Amp")?;
    let sum = stats.lines().find(|line| line.trim_start().starts_with("Sum"))?;
    // The Size column is a number and a unit: one word more in every row.
    sum.split_whitespace().nth(column + 1)?.parse().ok()
}

/// The process's resident memory once the allocator returned what it holds free (so
/// what the bench built and dropped does not count).
pub(crate) fn resident_bytes() -> Option<u64> {
    // SAFETY: glibc's malloc_trim takes no pointers; it only returns free memory.
    unsafe { libc::malloc_trim(0) };
    crate::restore::status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// Builds and measures one size in `dir`.
fn measure(
    args: &ScaleBenchArgs,
    entities: usize,
    dir: &Path,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<SizeFigures> {
    let path = dir.join(format!("store-{entities}"));
    if path.exists() {
        std::fs::remove_dir_all(&path)?; // a store left by an interrupted run
    }
    let now = tally_shared::kafka::now_ms();
    let rss_before = resident_bytes();
    let store = open(&path)?;
    let batch_max_bytes = tally_shared::config::CounterConfig::default().batch_max_bytes;
    let mut feed = Feed { next: 0, batch_max_bytes };
    let mut figures = SizeFigures { entities, ..Default::default() };
    figures.build_rate = build(&store, &mut feed, args, entities, now)?;
    let cf = store.counts_family()?;
    let db = store.rocks().db();
    // Each live stream starts with no compaction owed from before it.
    settle(&store)?;
    figures.write_amp = db.property_value_cf(cf, "rocksdb.cfstats")?.as_deref().and_then(write_amp);

    let zipf = Zipf::new(entities, 1.1);
    figures.zipf_rate = live_rate(&store, &mut feed, args, |rng| zipf.sample(rng), now)?.0;
    settle(&store)?;
    (figures.uniform_rate, figures.uniform_keys_rate, figures.uniform_stalled) =
        live_rate(&store, &mut feed, args, |rng| rng.random_range(0..entities), now)?;

    store.persist()?;
    db.compact_range_cf(cf, None::<&[u8]>, None::<&[u8]>);
    let sst_bytes = db.property_int_value_cf(cf, "rocksdb.total-sst-files-size")?.unwrap_or(0);
    figures.counts = db.property_int_value_cf(cf, "rocksdb.estimate-num-keys")?.unwrap_or(0);
    figures.bytes_per_count = sst_bytes as f64 / figures.counts.max(1) as f64;

    // Warm: Zipf keys, read once before they are timed.
    let warm = keys(args.reads, args.metrics, 23, |rng| zipf.sample(rng));
    let singles: Vec<&[(String, String)]> = warm.chunks(1).collect();
    read_path(&store, &singles, now)?;
    figures.warm.read = percentiles(read_path(&store, &singles, now)?);
    figures.warm.get = percentiles(plain_gets(&store, &singles)?);
    drop(zipf);
    figures.rss_bytes = rss_before.zip(resident_bytes()).map(|(before, after)| after.saturating_sub(before));

    // Cold: uniform keys, every cache dropped before each phase.
    let cold = keys(args.reads, args.metrics, 29, |rng| rng.random_range(0..entities));
    let singles: Vec<&[(String, String)]> = cold.chunks(1).collect();
    let batch_keys = keys(args.reads / 10 * BATCH, args.metrics, 31, |rng| rng.random_range(0..entities));
    let batches: Vec<&[(String, String)]> = batch_keys.chunks(BATCH).collect();
    let store = reopen_cold(store, &path)?;
    figures.cold.read = percentiles(read_path(&store, &singles, now)?);
    let store = reopen_cold(store, &path)?;
    figures.cold.get = percentiles(plain_gets(&store, &singles)?);
    let store = reopen_cold(store, &path)?;
    let batch_read = percentiles(read_path(&store, &batches, now)?).1;
    let store = reopen_cold(store, &path)?;
    figures.batch_p99 = (batch_read, percentiles(plain_gets(&store, &batches)?).1);

    // A shard that lost its disk: its snapshot restored.
    let trip = lose_and_restore(
        store,
        ShardStore::rocks,
        &path,
        (&format!("scale/shard-{entities}"), dir),
        runtime,
        open,
        |_| Ok(()),
    )?;
    (figures.snapshot_bytes, figures.restore_seconds) = (trip.snapshot_bytes, trip.restore_seconds);
    Ok(figures)
}

/// Measures every size, smallest first, in `args.dir`; the charts go to `args.plots`.
pub fn run(args: &ScaleBenchArgs, runtime: tokio::runtime::Handle) -> anyhow::Result<Vec<SizeFigures>> {
    anyhow::ensure!(!args.entities.is_empty() && args.metrics > 0 && args.per_counter > 0, "nothing to build");
    anyhow::ensure!(args.entities.windows(2).all(|w| w[0] < w[1]), "--entities: smallest first");
    anyhow::ensure!(args.entities.iter().all(|&n| ((n * args.metrics) as u128) < STRIDE), "at most {STRIDE} counters");
    std::fs::create_dir_all(&args.dir)?;
    let mut figures: Vec<SizeFigures> = Vec::new();
    for &entities in &args.entities {
        let increments = entities * args.metrics * args.per_counter;
        let estimate = figures
            .last()
            .map(|last| format!(", about {:.0} s at the last size's rate", increments as f64 / last.build_rate))
            .unwrap_or_default();
        println!("{}: {} increments to build{estimate}", short(entities), short(increments));
        let size = measure(args, entities, &args.dir, &runtime)?;
        println!("{}", row(&size, &figures.first().cloned().unwrap_or_else(|| size.clone())));
        figures.push(size);
    }
    Ok(figures)
}

/// `100 k`, `10 M`.
pub fn short(n: usize) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{} M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{} k", n / 1_000),
        n => n.to_string(),
    }
}

/// The table's header.
pub const HEADER: &str = "| entities | counts | build /s | apply Zipf /s (× first) | apply uniform /s (× first) | \
uniform keys written /s (× first) | uniform stalled | warm read p50/p99 µs (× get p99) | cold read p50/p99 µs (× get p99) | cold batch-100 p99 µs (× multi-get) | \
disk B/count (× value) | W-amp | RSS MB | restore s (snapshot MB) |\n\
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

/// One size's row, ratios against `first`'s rates and the same run's plain gets.
pub fn row(size: &SizeFigures, first: &SizeFigures) -> String {
    let ratio = |a: f64, b: f64| a / b.max(f64::MIN_POSITIVE);
    let value_bytes = Counts::increment(1).encode().as_ref().len() as f64;
    format!(
        "| {} | {:.1} M | {:.0} | {:.0} ({:.2}) | {:.0} ({:.2}) | {:.0} ({:.2}) | {} | {:.0}/{:.0} ({:.2}) | {:.0}/{:.0} ({:.2}) | {:.0} ({:.2}) | {:.1} ({:.2}) | {} | {} | {:.1} ({:.0}) |",
        short(size.entities),
        size.counts as f64 / 1e6,
        size.build_rate,
        size.zipf_rate,
        ratio(size.zipf_rate, first.zipf_rate),
        size.uniform_rate,
        ratio(size.uniform_rate, first.uniform_rate),
        size.uniform_keys_rate,
        ratio(size.uniform_keys_rate, first.uniform_keys_rate),
        size.uniform_stalled.map_or("-".into(), |share| format!("{:.0} %", share * 100.0)),
        size.warm.read.0,
        size.warm.read.1,
        ratio(size.warm.read.1, size.warm.get.1),
        size.cold.read.0,
        size.cold.read.1,
        ratio(size.cold.read.1, size.cold.get.1),
        size.batch_p99.0,
        ratio(size.batch_p99.0, size.batch_p99.1),
        size.bytes_per_count,
        ratio(size.bytes_per_count, value_bytes),
        size.write_amp.map_or("-".into(), |w| format!("{w:.1}")),
        size.rss_bytes.map_or("-".into(), |b| format!("{:.0}", b as f64 / 1e6)),
        size.restore_seconds,
        size.snapshot_bytes as f64 / 1e6,
    )
}

/// The charts of `figures`, as (file name, SVG).
pub fn charts(figures: &[SizeFigures]) -> Vec<(&'static str, String)> {
    let xs: Vec<f64> = figures.iter().map(|f| f.entities as f64).collect();
    let curve = |name: &str, y: &dyn Fn(&SizeFigures) -> Option<f64>| Series {
        name: name.into(),
        ys: figures.iter().map(y).collect(),
    };
    let ms = |us: f64| Some(us / 1e3);
    vec![
        (
            "scale-apply.svg",
            line_chart(
                "Apply rate",
                "entities",
                "per second",
                &xs,
                &[
                    curve("live Zipf increments", &|f| Some(f.zipf_rate)),
                    curve("live uniform increments", &|f| Some(f.uniform_rate)),
                    curve("live uniform count keys written", &|f| Some(f.uniform_keys_rate)),
                    curve("build", &|f| Some(f.build_rate)),
                ],
            ),
        ),
        (
            "scale-reads.svg",
            line_chart(
                "Point read p99",
                "entities",
                "ms",
                &xs,
                &[
                    curve("warm read", &|f| ms(f.warm.read.1)),
                    curve("warm get", &|f| ms(f.warm.get.1)),
                    curve("cold read", &|f| ms(f.cold.read.1)),
                    curve("cold get", &|f| ms(f.cold.get.1)),
                    curve("cold batch-100", &|f| ms(f.batch_p99.0)),
                ],
            ),
        ),
        (
            "scale-disk.svg",
            line_chart(
                "Disk per retained count",
                "entities",
                "bytes",
                &xs,
                &[curve("after compaction", &|f| Some(f.bytes_per_count)), curve("goal", &|_| Some(24.0))],
            ),
        ),
        (
            "scale-memory.svg",
            line_chart(
                "Resident memory serving the store",
                "entities",
                "MB",
                &xs,
                &[curve("RSS", &|f| f.rss_bytes.map(|b| b as f64 / 1e6))],
            ),
        ),
        (
            "scale-restore.svg",
            line_chart(
                "Restore from a snapshot",
                "entities",
                "seconds",
                &xs,
                &[curve("download and open", &|f| Some(f.restore_seconds))],
            ),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run: every counter built holds what was counted (its metrics, each
    /// all-time total its increments), the figures are measured, the charts drawn.
    #[test]
    fn a_small_scale_run_builds_every_counter_and_measures_each_size() {
        let dir = tempfile::tempdir().unwrap();
        let args = ScaleBenchArgs {
            entities: vec![300, 600],
            metrics: 2,
            per_counter: 3,
            live: 2_000,
            reads: 200,
            dir: dir.path().join("stores"),
            plots: dir.path().join("plots"),
        };
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let figures = run(&args, runtime.handle().clone()).unwrap();
        assert_eq!(figures.iter().map(|f| f.entities).collect::<Vec<_>>(), [300, 600]);
        for size in &figures {
            // Each counter's all-time, minute, hour and day keys, at least.
            assert!(size.counts >= (size.entities * args.metrics * 4) as u64, "{size:?}");
            assert!(size.zipf_rate > 0.0 && size.uniform_rate > 0.0 && size.build_rate > 0.0, "{size:?}");
            // Every increment writes its counter's keys, some coalesced with others'.
            assert!(size.uniform_keys_rate > 0.0 && size.uniform_keys_rate < 5.0 * size.uniform_rate, "{size:?}");
            assert!(size.cold.read.1 >= size.cold.read.0 && size.warm.get.1 > 0.0, "{size:?}");
            assert!(size.uniform_stalled.is_some_and(|share| (0.0..=1.0).contains(&share)), "{size:?}");
            assert!(size.restore_seconds > 0.0 && size.snapshot_bytes > 0, "{size:?}");
        }
        let left: Vec<_> = std::fs::read_dir(&args.dir).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        assert!(left.is_empty(), "each store removed once measured: {left:?}");
        assert_eq!(charts(&figures).len(), 5);

        // The build alone, read back whole.
        let path = dir.path().join("built");
        let store = open(&path).unwrap();
        let mut feed = Feed { next: 0, batch_max_bytes: 4_096 };
        build(&store, &mut feed, &args, 300, tally_shared::kafka::now_ms()).unwrap();
        for index in 0..300 {
            let page = store.metrics(&entity(index), None, 10).unwrap();
            let listed: Vec<(String, u128)> =
                page.metrics.iter().map(|m| (m.metric.clone(), m.total as u128)).collect();
            assert_eq!(listed, [(metric(0), 3), (metric(1), 3)], "{}", entity(index));
        }
    }

    #[test]
    fn the_write_amplification_is_read_from_the_sum_row() {
        let stats = "\n** Compaction Stats [counts] **\n\
Level    Files   Size     Score Read(GB)  Rn(GB) Rnp1(GB) Write(GB) Wnew(GB) Moved(GB) W-Amp Rd(MB/s)\n\
----------------------------------------------------------------------------------------------------\n\
  L0      2/0   12.50 MB   0.5      0.0     0.0      0.0       0.1      0.1       0.0   1.0      0.0\n\
 Sum      9/0   80.10 MB   0.0      0.4     0.1      0.3       0.6      0.5       0.0   4.7     10.0\n";
        assert_eq!(write_amp(stats), Some(4.7));
        assert_eq!(write_amp("no stats"), None);
    }

    #[test]
    fn the_stall_time_is_read_from_the_db_stats() {
        let stats = "\n** DB Stats **\nUptime(secs): 93.2 total, 10.0 interval\n\
Cumulative stall: 01:02:3.250 H:M:S, 2.5 percent\n\
Interval stall: 00:00:0.000 H:M:S, 0.0 percent\n";
        assert_eq!(stall(stats), Some(3723.25));
        assert_eq!(stall("Interval stall: 00:00:1.000 H:M:S, 0.0 percent"), None);
    }
}

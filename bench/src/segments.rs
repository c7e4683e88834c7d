//! `tally-bench segments`: what segments cost and what one breakdown saves, in
//! process on the counter's store (RocksDB on disk), each against its baseline in
//! the same run on the same data:
//! - the ingester's parse and the counter's apply of segmented increments (a state of
//!   50 and a device of 5, each Zipf-skewed) against the same increments plain;
//! - a breakdown of an entity's metric by state (one query, one walk of its
//!   combinations) against one filtered query per state, each its own read of the
//!   store, as 50 single reads would be (each also pays a round trip through
//!   tally-query, which this leaves out: the ratio is the store's floor);
//! - the bytes a combination adds on disk (the stores flushed, not compacted).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use tally_core::input::{parse_increments, Bounds};
use tally_core::segments::{Dimensions, Selector};
use tally_core::time::WindowSpec;
use tally_core::wire::{Kind, ShardMessage, ShardQuery, Source, Stamp};
use tally_counter::store::{ShardStore, StoreOptions};

use crate::counter_apply::{apply_in_batches, thread_cpu_seconds, Zipf};

/// States and devices a segmented increment draws from.
pub const STATES: usize = 50;
const DEVICES: usize = 5;

#[derive(Debug, Clone)]
pub struct SegmentBenchOptions {
    pub increments: usize,
    pub entities: usize,
    /// Breakdowns timed (each against its 50 filtered reads).
    pub reads: usize,
}

#[derive(Debug, Clone)]
pub struct SegmentFigures {
    /// Increments (events) per CPU-second of one thread: plain, segmented, and
    /// named (two increments per event).
    pub parse: (f64, f64, f64),
    pub apply: (f64, f64, f64),
    /// One breakdown's latencies and those of its 50 filtered reads, sorted (µs).
    pub breakdown_us: Vec<f64>,
    pub filtered_us: Vec<f64>,
    /// Groups a timed breakdown had, on average.
    pub groups: f64,
    /// SST bytes of each store once flushed, and the distinct combinations of the
    /// segmented one.
    pub disk_bytes: (u64, u64),
    pub combinations: usize,
}

/// The workload's messages, as producers send them (100 increments each).
struct Messages {
    plain: Vec<String>,
    segmented: Vec<String>,
    /// Segments faked with entity names: each event twice, on its entity and on an
    /// entity named after its combination (`answer:7|s3|d1`).
    named: Vec<String>,
    combinations: usize,
}

fn messages(options: &SegmentBenchOptions, now: i64) -> Messages {
    let mut rng = rand::rngs::StdRng::seed_from_u64(56);
    let (entities, states) = (Zipf::new(options.entities, 1.1), Zipf::new(STATES, 1.1));
    let (mut plain, mut segmented, mut named) = (Vec::new(), Vec::new(), Vec::new());
    let mut combinations = HashSet::new();
    for chunk in 0..options.increments.div_ceil(100) {
        let (mut p, mut s, mut n) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..100.min(options.increments - chunk * 100) {
            let entity = format!("answer:{}", entities.sample(&mut rng));
            let (state, device) = (states.sample(&mut rng), rng.random_range(0..DEVICES));
            let ts = now - rng.random_range(0..10_000);
            p.push(format!(r#"{{"entity":"{entity}","metric":"views","ts":{ts}}}"#));
            s.push(format!(
                r#"{{"entity":"{entity}","metric":"views","ts":{ts},"segments":{{"state":"s{state}","device":"d{device}"}}}}"#
            ));
            n.push(format!(r#"{{"entity":"{entity}","metric":"views","ts":{ts}}}"#));
            n.push(format!(r#"{{"entity":"{entity}|s{state}|d{device}","metric":"views","ts":{ts}}}"#));
            combinations.insert((entity, state, device));
        }
        plain.push(format!("[{}]", p.join(",")));
        segmented.push(format!("[{}]", s.join(",")));
        named.push(format!("[{}]", n.join(",")));
    }
    Messages { plain, segmented, named, combinations: combinations.len() }
}

fn dimensions() -> anyhow::Result<Dimensions> {
    let declared = BTreeMap::from([("views".to_string(), vec!["state".to_string(), "device".to_string()])]);
    Dimensions::new(declared).map_err(anyhow::Error::msg)
}

/// Parses `messages` as the ingester does: events per CPU-second (an event is
/// `per_event` increments), and the shard records (format 3) they make. Every
/// increment must be accepted (a rejection would time another path).
fn parse(messages: &[String], dimensions: &Dimensions, per_event: usize) -> anyhow::Result<(f64, Vec<Vec<u8>>)> {
    let started = thread_cpu_seconds();
    let mut parsed = Vec::with_capacity(messages.len());
    let mut count = 0usize;
    let mut rejected: Option<String> = None;
    for message in messages {
        let mut entries = Vec::with_capacity(100);
        parse_increments(
            message.as_bytes(),
            0,
            &Bounds::none(),
            dimensions,
            |index, increment| entries.push((Stamp { offset: parsed.len() as i64, index }, increment.into_owned())),
            |rejection| {
                rejected.get_or_insert(rejection.reason);
            },
        );
        count += entries.len();
        parsed.push(entries);
    }
    let rate = (count / per_event) as f64 / (thread_cpu_seconds() - started).max(1e-9);
    if let Some(reason) = rejected {
        anyhow::bail!("the workload has increments the ingester rejects: {reason}");
    }
    let source = Source { stream: Source::INCREMENTS, partition: 0 };
    let records = parsed
        .iter()
        .map(|entries| {
            ShardMessage::encode_increments(source, entries, tally_core::format::RECORD_V3).unwrap_or_default()
        })
        .collect();
    Ok((rate, records))
}

/// Applies `records` to a new store at `path`; increments per CPU-second.
fn apply(
    path: &Path,
    records: &[Vec<u8>],
    increments: usize,
    now: i64,
) -> tally_counter::error::Result<(ShardStore, f64)> {
    let store = ShardStore::open(0, path, StoreOptions::default())?;
    let started = thread_cpu_seconds();
    apply_in_batches(&store, records, tally_shared::config::CounterConfig::default().batch_max_bytes, now)?;
    let rate = increments as f64 / (thread_cpu_seconds() - started).max(1e-9);
    store.persist()?;
    Ok((store, rate))
}

/// The bytes of the SST files under `path`.
fn sst_bytes(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().extension().is_some_and(|e| e == "sst"))
        .filter_map(|entry| entry.metadata().ok())
        .map(|metadata| metadata.len())
        .sum()
}

pub fn run(options: &SegmentBenchOptions, dir: &Path) -> anyhow::Result<SegmentFigures> {
    let now = tally_shared::kafka::now_ms();
    let workload = messages(options, now);
    let dimensions = dimensions()?;
    // A warm-up parse first.
    parse(&workload.plain, &dimensions, 1)?;
    let (parse_plain, plain_records) = parse(&workload.plain, &dimensions, 1)?;
    let (parse_segmented, segmented_records) = parse(&workload.segmented, &dimensions, 1)?;
    let (parse_named, named_records) = parse(&workload.named, &dimensions, 2)?;
    let (plain_store, apply_plain) = apply(&dir.join("plain"), &plain_records, options.increments, now)?;
    let (named_store, apply_named) = apply(&dir.join("named"), &named_records, options.increments, now)?;
    let (store, apply_segmented) = apply(&dir.join("segmented"), &segmented_records, options.increments, now)?;
    let disk_bytes = (sst_bytes(&dir.join("plain")), sst_bytes(&dir.join("segmented")));
    drop((plain_store, named_store));
    let combinations = workload.combinations;

    // Breakdowns of the most popular entities, by state, over the last hour.
    let spec = WindowSpec::Last { window_ms: 3_600_000 };
    let read_zipf = Zipf::new(options.entities, 1.1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut breakdown_us, mut filtered_us, mut groups) = (Vec::new(), Vec::new(), 0usize);
    for _ in 0..options.reads {
        let entity = format!("answer:{}", read_zipf.sample(&mut rng));
        let plain = ShardQuery::plain(entity, "views".into(), Kind::Total, spec);
        let by_state =
            ShardQuery { segments: Some(Selector { filters: vec![], by: Some("state".into()) }), ..plain.clone() };
        let started = Instant::now();
        let answer = store.read(std::slice::from_ref(&by_state), now)?;
        breakdown_us.push(started.elapsed().as_secs_f64() * 1e6);
        if let Some(tally_core::wire::ShardAnswer::Segments { groups: found, .. }) = answer.first() {
            groups += found.len();
        }
        let started = Instant::now();
        for state in 0..STATES {
            let filter = Selector { filters: vec![("state".into(), Some(format!("s{state}")))], by: None };
            store.read(&[ShardQuery { segments: Some(filter), ..plain.clone() }], now)?;
        }
        filtered_us.push(started.elapsed().as_secs_f64() * 1e6);
    }
    breakdown_us.sort_by(f64::total_cmp);
    filtered_us.sort_by(f64::total_cmp);
    Ok(SegmentFigures {
        parse: (parse_plain, parse_segmented, parse_named),
        apply: (apply_plain, apply_segmented, apply_named),
        breakdown_us,
        filtered_us,
        groups: groups as f64 / options.reads.max(1) as f64,
        disk_bytes,
        combinations,
    })
}

/// The value at quantile `q` of sorted `values`.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    values.get(((values.len() as f64 * q) as usize).min(values.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny run: the breakdown and the filtered reads read the same store, and the
    /// segmented store holds the plain one's counts (figures come from the command).
    #[test]
    fn a_tiny_run_reads_what_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let options = SegmentBenchOptions { increments: 2_000, entities: 20, reads: 3 };
        let figures = run(&options, dir.path()).unwrap();
        assert_eq!((figures.breakdown_us.len(), figures.filtered_us.len()), (3, 3));
        assert!(figures.groups >= 1.0, "{figures:?}");
        assert!(figures.disk_bytes.1 > figures.disk_bytes.0, "{figures:?}");
        let plain = ShardStore::open(0, &dir.path().join("plain"), StoreOptions::default()).unwrap();
        let segmented = ShardStore::open(0, &dir.path().join("segmented"), StoreOptions::default()).unwrap();
        for entity in 0..20 {
            let entity = format!("answer:{entity}");
            assert_eq!(
                plain.metrics(&entity, None, 10).unwrap().metrics,
                segmented.metrics(&entity, None, 10).unwrap().metrics
            );
        }
    }
}

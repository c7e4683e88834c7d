//! `tally-bench counter`: the apply path on a Zipf-skewed workload, against a
//! per-event, no-coalescing baseline run in the same process on the same data.
//!
//! Both paths decode the same shard messages and write the same buckets to a real
//! RocksDB on disk; the baseline writes one RocksDB batch per increment, the real
//! path one per batch of records with deltas coalesced per bucket.

use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rocksdb::WriteBatch;
use tally_core::format::RECORD_V3;
use tally_core::keys::{encode_count_key, Counts, ALL_TIME_WIDTH};
use tally_core::time::bucket_start;
use tally_core::wire::{Increment, ShardMessage, ShardMessageRef, Source, Stamp};

use tally_counter::error::Result;
use tally_counter::store::apply::ShardRecord;
use tally_counter::store::{ShardStore, StoreOptions};

/// The shape of the workload.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Increments through the coalescing path.
    pub increments: usize,
    /// Increments through the baseline (slower, so fewer).
    pub baseline_increments: usize,
    pub entities: usize,
    pub metrics: usize,
    /// Zipf exponent of entity popularity.
    pub zipf_exponent: f64,
    /// Increments per shard record (what the ingester packs together).
    pub increments_per_record: usize,
    /// Shard-record payload bytes per applied batch (`counter.batch_max_bytes`).
    pub batch_max_bytes: usize,
    /// Event times are spread over this many ms before now (a live stream: seconds).
    pub event_spread_ms: i64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            increments: 5_000_000,
            baseline_increments: 200_000,
            entities: 100_000,
            metrics: 4,
            zipf_exponent: 1.1,
            increments_per_record: 100,
            batch_max_bytes: tally_shared::config::CounterConfig::default().batch_max_bytes,
            event_spread_ms: 10_000,
        }
    }
}

#[derive(Debug, Clone)]
pub struct BenchReport {
    pub coalesced_per_sec: f64,
    /// Coalesced increments per CPU-second of the applying thread alone (RocksDB's
    /// flushes and compactions run on background threads).
    pub coalesced_per_cpu_sec: f64,
    pub baseline_per_sec: f64,
    /// Mean increments per coalesced batch.
    pub increments_per_batch: f64,
    /// Mean distinct bucket keys written per coalesced batch.
    pub keys_per_batch: f64,
}

impl BenchReport {
    pub fn ratio(&self) -> f64 {
        self.coalesced_per_sec / self.baseline_per_sec.max(f64::MIN_POSITIVE)
    }
}

/// Ranks `0..n` drawn with a Zipf(`exponent`) skew: rank 0 the most popular, as
/// producers' traffic is. The benchmarks' one sampler.
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, exponent: f64) -> Self {
        let mut sum = 0.0;
        let cumulative = (1..=n.max(1))
            .map(|rank| {
                sum += 1.0 / (rank as f64).powf(exponent);
                sum
            })
            .collect();
        Self { cumulative }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let draw = rng.random::<f64>() * total;
        self.cumulative.partition_point(|&c| c < draw).min(self.cumulative.len() - 1)
    }
}

/// Encoded shard records of a Zipf workload.
pub(crate) fn workload(options: &BenchOptions, count: usize, now: i64, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(options.entities, options.zipf_exponent);
    let mut records = Vec::new();
    let mut offset = 0i64;
    let mut remaining = count;
    while remaining > 0 {
        let n = remaining.min(options.increments_per_record);
        remaining -= n;
        let entries: Vec<(Stamp, Increment)> = (0..n)
            .map(|index| {
                let entity = zipf.sample(&mut rng);
                let increment = Increment {
                    entity: format!("answer:{entity}"),
                    metric: format!("metric{}", rng.random_range(0..options.metrics)),
                    delta: 1,
                    ts: now - rng.random_range(0..options.event_spread_ms.max(1)),
                    id: None,
                };
                (Stamp { offset, index: index as u32 }, increment)
            })
            .collect();
        offset += 1;
        // As an ingester writes them (format 3: packed).
        let source = Source { stream: Source::INCREMENTS, partition: 0 };
        records.push(ShardMessage::encode_increments(source, &entries, RECORD_V3).unwrap_or_default());
    }
    records
}

fn open(dir: &Path, name: &str) -> Result<ShardStore> {
    ShardStore::open(0, &dir.join(name), StoreOptions::default())
}

/// Runs both paths in `dir` (a scratch directory) and reports their rates.
pub fn run(options: &BenchOptions, dir: &Path) -> Result<BenchReport> {
    let now = tally_shared::kafka::now_ms();

    let records = workload(options, options.increments, now, 7);
    let store = open(dir, "coalesced")?;
    let started = Instant::now();
    let started_cpu = thread_cpu_seconds();
    let (batches, keys) = apply_in_batches(&store, &records, options.batch_max_bytes, now)?;
    let coalesced_per_sec = options.increments as f64 / started.elapsed().as_secs_f64();
    let coalesced_per_cpu_sec = options.increments as f64 / (thread_cpu_seconds() - started_cpu).max(1e-9);
    drop(store);

    let records = workload(options, options.baseline_increments, now, 7);
    let store = open(dir, "baseline")?;
    let started = Instant::now();
    apply_per_event(&store, &records, now)?;
    let baseline_per_sec = options.baseline_increments as f64 / started.elapsed().as_secs_f64();

    let batches = batches.max(1) as f64;
    Ok(BenchReport {
        coalesced_per_sec,
        coalesced_per_cpu_sec,
        baseline_per_sec,
        increments_per_batch: options.increments as f64 / batches,
        keys_per_batch: keys as f64 / batches,
    })
}

/// Applies `records` to `store` as the consumer does, in batches of `max_bytes`;
/// how many batches, and the distinct keys they wrote.
pub(crate) fn apply_in_batches(
    store: &ShardStore,
    records: &[Vec<u8>],
    max_bytes: usize,
    now: i64,
) -> Result<(usize, usize)> {
    let (mut batches, mut keys, mut offset) = (0usize, 0usize, 0i64);
    for chunk in batches_of(records, max_bytes) {
        let shard_records: Vec<ShardRecord<'_>> = chunk
            .iter()
            .map(|payload| {
                offset += 1;
                ShardRecord { offset, payload, timestamp: None }
            })
            .collect();
        keys += store.apply(&shard_records, now, false)?.keys;
        batches += 1;
    }
    Ok((batches, keys))
}

/// CPU time the calling thread has used.
pub fn thread_cpu_seconds() -> f64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// Splits `records` the way the consumer does: a batch closes once it holds
/// `max_bytes` of payload (unpacked).
pub(crate) fn batches_of(records: &[Vec<u8>], max_bytes: usize) -> impl Iterator<Item = &[Vec<u8>]> {
    let mut rest = records;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let end = rest.iter().position(|r| {
            bytes += tally_core::wire::packed::unpacked_len(r);
            bytes >= max_bytes
        });
        let (batch, tail) = rest.split_at(end.map_or(rest.len(), |i| i + 1));
        rest = tail;
        Some(batch)
    })
}

/// The baseline: every increment is its own RocksDB write of its buckets, committed
/// with its position like any write of the store.
fn apply_per_event(store: &ShardStore, records: &[Vec<u8>], now: i64) -> Result<()> {
    let cf = store.counts_family()?;
    let resolutions = &store.store_options().resolutions;
    let mut key = Vec::with_capacity(128);
    for (offset, payload) in records.iter().enumerate() {
        let payload = tally_core::wire::packed::unpack(payload)?;
        let ShardMessageRef::Increments { entries, .. } = ShardMessageRef::decode(&payload)? else { continue };
        for (_, increment) in entries {
            let counts = Counts::increment(increment.delta).encode();
            let mut batch = WriteBatch::default();
            key.clear();
            encode_count_key(&mut key, increment.entity, increment.metric, ALL_TIME_WIDTH, 0);
            batch.merge_cf(cf, &key, counts);
            for resolution in resolutions.iter() {
                let bucket = bucket_start(increment.ts, resolution.width_ms);
                if resolution.retains(bucket, now) {
                    key.clear();
                    encode_count_key(&mut key, increment.entity, increment.metric, resolution.width_ms, bucket);
                    batch.merge_cf(cf, &key, counts);
                }
            }
            let mut progress = store.progress();
            progress.next_offset = Some(offset as i64 + 1);
            store.commit(batch, progress)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny run checks that both paths agree on what they wrote (the bench's
    /// figures come from `tally-bench counter`, never from a timed test).
    #[test]
    fn both_paths_write_the_same_counts() {
        let dir = tempfile::tempdir().unwrap();
        let options = BenchOptions {
            increments: 5_000,
            baseline_increments: 5_000,
            entities: 50,
            batch_max_bytes: 20_000,
            ..Default::default()
        };
        let report = run(&options, dir.path()).unwrap();
        assert!(report.keys_per_batch > 0.0);
        assert!(report.increments_per_batch < 5_000.0, "several batches: {}", report.increments_per_batch);
        let coalesced = open(dir.path(), "coalesced").unwrap();
        let baseline = open(dir.path(), "baseline").unwrap();
        for entity in 0..50 {
            let page_c = coalesced.metrics(&format!("answer:{entity}"), None, 10).unwrap();
            let page_b = baseline.metrics(&format!("answer:{entity}"), None, 10).unwrap();
            assert_eq!(page_c.metrics, page_b.metrics, "answer:{entity}");
        }
        let total: tally_core::keys::Count = (0..50)
            .flat_map(|e| coalesced.metrics(&format!("answer:{e}"), None, 10).unwrap().metrics)
            .map(|m| m.total)
            .sum();
        assert_eq!(total, 5_000);
    }
}

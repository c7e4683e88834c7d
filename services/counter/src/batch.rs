//! One polled batch applied: each shard's records in offset order, shards spread
//! over the apply loop and its helper threads, late records joining their shard as
//! it starts, a failed shard stopped alone.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::ConsumerContext;
use tally_core::trace::{sampled, Span, SpanKind};
use tally_shared::consume::Polled;
use tally_shared::failures::Failure;
use tally_shared::kafka::now_ms;

use crate::late::LateRecords;
use crate::metrics::Metrics;
use crate::shards::Shards;
use crate::store::apply::{ApplyReport, ShardRecord};

/// Applies a polled batch, each shard's records in offset order, on up to
/// `threads` threads that take whole shards, the biggest first (each shard is a
/// RocksDB of its own, and only this batch writes it); returns how many outbox
/// messages it wrote and the shards that failed in it. A failed shard applies
/// nothing more (records of it polled before it was paused are dropped: its
/// store's offset stays at the failure); the others go on.
///
/// `helpers`: how many threads start on it, and how many more join, asked between
/// the loop's shards given how many run. The helper threads run as nice as the
/// apply loop; the loop starts them only while cores sat idle as the batch gathered,
/// or joins them once cores fell idle as it was applied ([`HelperGauge`]): on 2
/// cores shared with the ingester and the broker, helpers in every batch would apply a
/// backlog sooner but make batch reads while ingesting slower (BENCHMARKS.md,
/// "Reads").
///
/// With `late`, records that arrived meanwhile join each shard as it starts
/// ([`crate::late`]).
pub(crate) fn apply_batch<C: ConsumerContext>(
    batch: &[Polled],
    late: Option<&LateRecords<'_, C>>,
    shards: &Shards,
    metrics: &Metrics,
    mark_rollups: bool,
    (threads, join): (usize, impl FnMut(usize) -> usize),
) -> (u64, Vec<u32>) {
    let mut by_shard: BTreeMap<u32, Vec<ShardRecord<'_>>> = BTreeMap::new();
    for polled in batch {
        by_shard.entry(polled.partition as u32).or_default().push(shard_record(polled));
    }
    let mut work: Vec<(u32, Vec<ShardRecord<'_>>)> = by_shard.into_iter().collect();
    for (_, records) in &mut work {
        records.sort_by_key(|r| r.offset);
    }
    // The biggest first, so that the threads finish about together.
    work.sort_by_cached_key(|(shard, records)| {
        (Reverse(records.iter().map(|r| r.payload.len()).sum::<usize>()), *shard)
    });
    let now = now_ms();
    let taken = AtomicUsize::new(0);
    let apply_next = || {
        let (shard, records) = work.get(taken.fetch_add(1, Ordering::Relaxed))?;
        let late = late.map(|late| late.start(*shard)).unwrap_or_default();
        metrics.late_records.inc_by(late.len() as u64);
        let records = match late.is_empty() {
            true => Cow::Borrowed(records),
            false => Cow::Owned(records.iter().copied().chain(late.iter().map(shard_record)).collect()),
        };
        let (written, failed) = apply_shard(*shard, &records, shards, metrics, mark_rollups, now);
        Some((written, failed.then_some(*shard)))
    };
    let (applied, ran) = tally_shared::sched::on_threads(threads.min(work.len()), "counter-apply+", join, apply_next);
    // A helper that could not start is not counted.
    if ran > 1 {
        metrics.helped_batches.inc();
    }
    let written = applied.iter().map(|(written, _)| written).sum();
    (written, applied.into_iter().filter_map(|(_, failed)| failed).collect())
}

/// The span of applying a batch whose records carry trace contexts (their input
/// records'): it links them, as OpenTelemetry's messaging conventions have a batch
/// consumer do; an error when a shard failed in it.
pub(crate) fn batch_span(topic: &str, group: &str, started: u64, batch: &[Polled], failed: &[u32]) -> Option<Span> {
    let contexts = sampled(batch.iter().flat_map(|polled| polled.traces.iter().copied()));
    if contexts.is_empty() {
        return None;
    }
    let mut span = Span::start(format!("process {topic}"), SpanKind::Consumer, None).link(contexts);
    let mut shards: Vec<u32> = batch.iter().map(|polled| polled.partition as u32).collect();
    shards.sort_unstable();
    shards.dedup();
    let shards = shards.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    span = span
        .attribute("messaging.system", "kafka")
        .attribute("messaging.operation.type", "process")
        .attribute("messaging.destination.name", topic)
        .attribute("messaging.consumer.group.name", group)
        .attribute("messaging.batch.message_count", batch.len() as i64)
        .attribute("tally.shards", shards);
    span.start_unix_nanos = started;
    if !failed.is_empty() {
        span.error = Some(format!("shards {failed:?} failed (/readyz names why)"));
    }
    Some(span.end())
}

fn shard_record(polled: &Polled) -> ShardRecord<'_> {
    ShardRecord { offset: polled.offset, payload: &polled.payload, timestamp: polled.timestamp }
}

/// Applies one shard's records of a batch (in offset order) at `now` (the batch's
/// wall-clock time, for retention and records without a time): the outbox messages
/// it wrote (those of the records before a failure are committed too), and whether
/// the shard failed (recorded on the failure board).
fn apply_shard(
    shard: u32,
    records: &[ShardRecord<'_>],
    shards: &Shards,
    metrics: &Metrics,
    mark_rollups: bool,
    now: i64,
) -> (u64, bool) {
    let Some(store) = shards.get(shard).filter(|_| !shards.failures.is_failed(shard)) else { return (0, false) };
    let started = Instant::now();
    let report = match store.apply(records, now, mark_rollups) {
        Ok(report) => report,
        Err(err) => {
            let offset = store.next_offset();
            shards.failures.fail(shard, Failure { offset, reason: err.to_string(), record: None });
            return (0, true);
        }
    };
    metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
    record_metrics(metrics, &report);
    let mut failed = false;
    if let Some((next, found)) = report.gap {
        let reason = format!("the log has no records {next}..{found} the store has not applied (deleted by retention, or the topic was recreated): restore or rebuild the shard");
        shards.failures.fail(shard, Failure { offset: Some(next), reason, record: None });
        failed = true;
    }
    if let Some((offset, reason)) = &report.undecodable {
        let record = records.iter().find(|r| r.offset == *offset).map(|r| Arc::new(r.payload.to_vec()));
        shards.failures.fail(shard, Failure { offset: Some(*offset), reason: reason.clone(), record });
        metrics.undecodable_records.inc();
        failed = true;
    }
    (report.outbox_messages, failed)
}

fn record_metrics(metrics: &Metrics, report: &ApplyReport) {
    metrics.applied_increments.inc_by(report.increments);
    metrics.duplicates.with_label_values(&["redelivered"]).inc_by(report.redelivered);
    metrics.duplicates.with_label_values(&["id"]).inc_by(report.duplicate_ids);
    metrics.segment_overflows.inc_by(report.segment_overflows);
    metrics.batch_records.observe(report.records as f64);
    metrics.batch_keys.observe(report.keys as f64);
    metrics.graph_entries.with_label_values(&["desc_change"]).inc_by(report.desc_changes);
    metrics.graph_entries.with_label_values(&["remote_total"]).inc_by(report.totals_received);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus::Registry;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    use tally_core::time::WindowSpec;
    use tally_core::wire::{Increment, Kind, ShardAnswer, ShardMessage, ShardQuery, Source, Stamp};

    use super::*;
    use crate::context::store_name;
    use crate::store::{ShardStore, StoreOptions};

    const NOW: i64 = 1_763_776_800_000;
    const SHARDS: u32 = 5;

    /// A shard record of increments of `views`, one per (entity, delta).
    fn increments(shard: u32, offset: i64, events: &[(&str, i64)]) -> Polled {
        let entries = events
            .iter()
            .enumerate()
            .map(|(index, &(entity, delta))| {
                let increment = Increment { entity: entity.into(), metric: "views".into(), delta, ts: NOW, id: None };
                (Stamp { offset, index: index as u32 }, increment)
            })
            .collect();
        let source = Source { stream: Source::INCREMENTS, partition: shard };
        let payload = ShardMessage::Increments { source, entries }.encode().unwrap();
        Polled { partition: shard as i32, offset, timestamp: Some(NOW), payload, drained: false, traces: Vec::new() }
    }

    /// A shard's next offset and the all-time totals of some entities.
    type ShardState = (Option<i64>, Vec<tally_core::keys::Count>);

    /// Every shard's state after applying `batch` on `threads` threads, and what
    /// `apply_batch` returned.
    fn applied(batch: &[Polled], entities: &[&str], threads: usize) -> ((u64, Vec<u32>), Vec<ShardState>) {
        applied_with(batch, None::<&LateRecords<'_, rdkafka::consumer::DefaultConsumerContext>>, entities, threads)
    }

    /// [`applied`], with records that arrive meanwhile taken from `late`.
    fn applied_with<C: ConsumerContext>(
        batch: &[Polled],
        late: Option<&LateRecords<'_, C>>,
        entities: &[&str],
        threads: usize,
    ) -> ((u64, Vec<u32>), Vec<ShardState>) {
        let dir = tempfile::tempdir().unwrap();
        let stores = (0..SHARDS)
            .map(|shard| {
                let options = StoreOptions { shards: SHARDS, ..StoreOptions::default() };
                (
                    shard,
                    Arc::new(
                        ShardStore::open(shard, &dir.path().join(store_name("t", shard).dir_name()), options).unwrap(),
                    ),
                )
            })
            .collect();
        let shards = Shards::default();
        shards.replace(stores, Default::default(), BTreeMap::new());
        let mut returned = apply_batch(batch, late, &shards, &Metrics::new(&Registry::new()), true, (threads, |_| 0));
        returned.1.sort();
        let states = (0..SHARDS)
            .map(|shard| {
                let store = shards.get(shard).unwrap();
                let queries: Vec<ShardQuery> = entities
                    .iter()
                    .map(|entity| ShardQuery::plain(entity.to_string(), "views".into(), Kind::Total, WindowSpec::All))
                    .collect();
                let totals = store.read(&queries, NOW).unwrap().into_iter().map(|answer| match answer {
                    ShardAnswer::Window { value, .. } => value,
                    other => panic!("{other:?}"),
                });
                (store.next_offset(), totals.collect())
            })
            .collect();
        (returned, states)
    }

    /// Records that came while the batch was applied join the shard it had not
    /// started (a copy of one the batch holds is skipped by its offset); those of a
    /// shard not in the batch are carried to the next.
    #[test]
    fn late_records_are_applied_with_their_shard_and_the_rest_carried() {
        use rdkafka::mocking::MockCluster;
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("shards", SHARDS as i32, 1).unwrap();
        let kafka =
            tally_shared::config::KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let (first, later) = (increments(1, 0, &[("e1", 2)]), increments(1, 1, &[("e1", 3), ("e6", 4)]));
        let other = increments(2, 0, &[("e2", 5)]);
        let producer: BaseProducer = tally_shared::kafka::client_config(&kafka).unwrap().create().unwrap();
        for record in [&first, &later, &other] {
            let to = BaseRecord::<(), _>::to("shards").partition(record.partition).payload(&record.payload);
            producer.send(to).unwrap();
        }
        producer.flush(Duration::from_secs(5)).unwrap();
        let mut config = tally_shared::kafka::consumer_config(&kafka).unwrap();
        config.set("group.id", "late-apply-test").set("enable.auto.commit", "false");
        let consumer: BaseConsumer = config.create().unwrap();
        let mut assignment = TopicPartitionList::new();
        for partition in [1, 2] {
            assignment.add_partition_offset("shards", partition, Offset::Beginning).unwrap();
        }
        consumer.assign(&assignment).unwrap();

        let late = LateRecords::new(&consumer, [1], usize::MAX, tally_shared::consume::as_fetched);
        let all = [&first, &later, &other].iter().map(|record| record.payload.len()).sum();
        let deadline = Instant::now() + Duration::from_secs(10);
        while late.polled_bytes() < all && Instant::now() < deadline {
            assert_eq!(late.start(99).len(), 0, "shard 99 is not in the batch");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (returned, states) = applied_with(std::slice::from_ref(&first), Some(&late), &["e1", "e2", "e6"], 1);
        assert_eq!(returned, (0, vec![]));
        assert_eq!(states[1], (Some(2), vec![5, 0, 4]), "the batch's record and the late one, once each");
        assert_eq!(states[2], (None, vec![0, 0, 0]), "shard 2 was not in the batch");
        let carried: Vec<(i32, i64)> = late.into_carried().iter().map(|r| (r.partition, r.offset)).collect();
        assert_eq!(carried, [(2, 0)]);
    }

    /// Each nice value of this process's threads named `rocksdb:*`.
    fn rocksdb_threads_nice() -> Vec<(String, i32)> {
        let mut threads = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
            // `tid (comm) state ...`: nice is the 19th field, the 17th after the name.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
            let name = &stat[open + 1..close];
            let nice = stat[close + 2..].split(' ').nth(16).and_then(|field| field.parse().ok());
            if let (true, Some(nice)) = (name.starts_with("rocksdb:"), nice) {
                threads.push((name.to_string(), nice));
            }
        }
        threads.sort();
        threads
    }

    /// RocksDB's shared threads keep the counter's priority though the apply loop,
    /// which opens the stores of shards as they come, runs nicer. In a process of
    /// its own (this test binary again, running this test alone): the threads are
    /// the process's, started by whichever test opens a store first.
    #[test]
    fn rocksdb_threads_keep_the_counters_priority_when_the_nicer_loop_opens_stores() {
        const ALONE: &str = "TALLY_TEST_ROCKSDB_THREADS_ALONE";
        let name = "batch::tests::rocksdb_threads_keep_the_counters_priority_when_the_nicer_loop_opens_stores";
        if std::env::var_os(ALONE).is_none() {
            let run = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--nocapture", "--test-threads", "1"])
                .env(ALONE, "1")
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&run.stdout);
            assert!(
                run.status.success() && out.contains("test result: ok. 1 passed"),
                "{out}{}",
                String::from_utf8_lossy(&run.stderr)
            );
            return;
        }
        assert_eq!(rocksdb_threads_nice(), [], "no store opened yet in this process");
        let base = tally_shared::sched::nice().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let nicer = std::thread::spawn(move || {
            ShardStore::start_background_threads().unwrap();
            let nicer = tally_shared::sched::lower_priority(5).unwrap();
            let store = ShardStore::open(0, &path, StoreOptions::default()).unwrap();
            drop(store);
            nicer
        })
        .join()
        .unwrap();
        assert_eq!(nicer, base + 5);
        let threads = rocksdb_threads_nice();
        let expected: Vec<(String, i32)> =
            ["rocksdb:high", "rocksdb:low"].into_iter().map(|name| (name.to_string(), base)).collect();
        assert_eq!(threads, expected);
    }

    /// Each shard's records apply in offset order, however they were polled and
    /// however many threads share the shards; a shard with a bad record stops at
    /// it, the others apply all of theirs.
    #[test]
    fn a_batch_applies_shard_by_shard_in_offset_order_and_a_bad_record_stops_its_shard_only() {
        let mut bad = increments(2, 1, &[("c", 1)]);
        bad.payload.truncate(bad.payload.len() / 2);
        // Out of offset order within shards, as several fetches can hand them over.
        let batch = vec![
            increments(0, 1, &[("a", 2), ("b", 3)]),
            increments(1, 0, &[("a", 5)]),
            increments(0, 0, &[("a", 7)]),
            bad,
            increments(2, 0, &[("c", 11), ("c", 13)]),
            increments(3, 0, &[("d", 17)]),
            increments(2, 2, &[("c", 19)]),
            increments(3, 1, &[("d", 23), ("a", 29)]),
        ];
        let entities = ["a", "b", "c", "d"];
        let expected = (
            (0, vec![2]),
            vec![
                (Some(2), vec![9, 3, 0, 0]),
                (Some(1), vec![5, 0, 0, 0]),
                (Some(1), vec![0, 0, 24, 0]),
                (Some(2), vec![29, 0, 0, 40]),
                (None, vec![0, 0, 0, 0]),
            ],
        );
        for threads in [1, 2, 8] {
            assert_eq!(applied(&batch, &entities, threads), expected, "{threads} threads");
        }
    }
}

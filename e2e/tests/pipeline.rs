//! The counting pipeline end to end: a random workload through Kafka, every HTTP
//! answer compared with the brute-force model, every rejection in the dead-letter
//! topic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use rdkafka::producer::{DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use tally_core::format::INPUT_DRAINED_HEADER;
use tally_core::wire::{DeadLetter, Rollup, ShardMessage};
use tally_e2e::workload::Workload;
use tally_e2e::{check, ReadRecord, Sandbox};
use tally_shared::kafka::{producer_config, request_producer_id};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_windows_series_and_dead_letters_match_the_model() {
    let mut sandbox = Sandbox::start().await;
    // The query service is not ready while no counter owns the shards; it is once one does.
    sandbox.spawn("tally-query");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(sandbox.readyz("tally-query").await, 503, "query ready without any shard owner");
    for service in ["tally-ingester", "tally-counter"] {
        sandbox.spawn(service);
    }
    for service in ["tally-ingester", "tally-counter", "tally-query"] {
        sandbox.wait_ready(service, Duration::from_secs(60)).await;
    }
    let workload = Workload::generate(1, 400, tally_shared::kafka::now_ms());
    sandbox.produce(&workload.records).await;

    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;
    check::series(&sandbox, model, &entities[..6], metrics).await;
    check::series(&sandbox, model, &entities[entities.len() - 2..], metrics).await;
    check::listings(&sandbox, model, entities).await;
    check::bad_requests(&sandbox).await;
    // Negative control: the same comparison with one event too many must fail.
    let mut wrong = model.clone();
    let extra = tally_core::wire::Increment {
        entity: entities[0].clone(),
        metric: metrics[0].clone(),
        delta: 1,
        ts: tally_shared::kafka::now_ms(),
        id: None,
    };
    wrong.apply(extra);
    // Negative controls: each comparison fails with one event too many, or a valid request.
    assert!(check::all_time(&sandbox, &wrong, entities, metrics).await.is_err(), "all_time can fail");
    let first = &entities[..1];
    assert!(check::try_windows(&sandbox, &wrong, first, metrics).await.is_err(), "windows can fail");
    assert!(check::try_series(&sandbox, &wrong, first, metrics).await.is_err(), "series can fail");
    assert!(check::try_listings(&sandbox, &wrong, first).await.is_err(), "listings can fail");
    let valid = format!("/v1/counters/{}/{}", tally_e2e::encode(&entities[0]), tally_e2e::encode(&metrics[0]));
    assert!(check::bad_request(&sandbox, &valid).await.is_err(), "bad_request can fail");

    // The counter's metrics agree: every shard caught up, every accepted increment applied once.
    let applied = sandbox.metric("tally-counter", "tally_counter_applied_increments_total").await;
    assert_eq!(applied.iter().map(|(_, v)| *v).sum::<f64>(), workload.model.events().len() as f64, "{applied:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let lag = sandbox.metric("tally-counter", "tally_counter_consumer_lag_records").await;
        if lag.len() == 8 && lag.iter().all(|(_, v)| *v == 0.0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "lag never reached 0 on 8 shards: {lag:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The latest all-time rollup of every counter equals the model.
    let rollups = sandbox.latest_rollups(Duration::from_secs(10));
    let latest: std::collections::HashMap<(String, String), &Rollup> = rollups
        .live()
        .filter(|(_, rollup)| rollup.resolution == "all")
        .map(|(_, rollup)| ((rollup.entity.clone(), rollup.metric.clone()), rollup))
        .collect();
    for entity in entities {
        for (metric, (_, total)) in model.metrics(entity) {
            let rollup = latest
                .get(&(entity.clone(), metric.clone()))
                .unwrap_or_else(|| panic!("no rollup for {entity} {metric}"));
            assert_eq!((rollup.total, rollup.direct), (total, total), "{entity} {metric}");
        }
    }

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), workload.rejections + 1, Duration::from_secs(20));
    assert_eq!(letters.len(), workload.rejections, "every rejection, once");
    for raw in letters {
        let letter: DeadLetter = serde_json::from_slice(&raw).expect("dead letters are JSON");
        assert_eq!(letter.topic, sandbox.names.increments());
        assert!(!letter.reason.is_empty());
        base64::engine::general_purpose::STANDARD.decode(&letter.payload).expect("payload is base64");
    }
}

/// A week-old backfill on a cluster that bounds how old a record's timestamp may be
/// when it is appended (`log.message.timestamp.before.max.ms`): every record tally
/// writes is stamped when it is written (an input's time travels in the
/// `tally.record-time.v1` header), so such a broker takes them all, and the week-old
/// events count in their own buckets. The local broker does not enforce the bound;
/// the check does what it would with an hour's: each record's timestamp against when
/// it was appended, which is no earlier than the test's start. The input topics are
/// the producer's, written with the events' week-old times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_week_old_backfill_counts_in_its_buckets_and_every_record_tally_writes_is_stamped_when_written() {
    // A week old, less the hour that keeps it within the input topics' retention.
    const AGE_MS: i64 = 7 * 86_400_000 - 3_600_000;
    const BOUND_MS: i64 = 3_600_000;
    let mut sandbox = Sandbox::start().await;
    let started = tally_shared::kafka::now_ms();
    for service in ["tally-ingester", "tally-counter", "tally-graph", "tally-query"] {
        sandbox.spawn(service);
    }
    let workload = Workload::generate_mixed(57, 300, started - AGE_MS, 0.2);
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;
    check::series(&sandbox, model, &entities[..4], metrics).await;
    // Input records of a week ago, events of a week to ten days ago.
    let input_time = |ts: i64| (started - AGE_MS - 60_000..=started - AGE_MS).contains(&ts);
    assert!(
        !model.events().is_empty() && model.events().iter().all(|event| event.ts <= started - AGE_MS),
        "every event is a week old or older"
    );

    let (shards, graph_updates) = (sandbox.names.shards(), sandbox.names.graph_updates());
    let mut late = Vec::new();
    let mut read = std::collections::BTreeMap::new();
    for topic in [&shards, &graph_updates, &sandbox.names.rollups(), &sandbox.names.dead_letter()] {
        let written: i64 = (0..sandbox.partition_count(topic) as i32).map(|p| sandbox.next_offset(topic, p)).sum();
        let records = sandbox.read_records(topic, Duration::from_secs(30), |read| read.len() as i64 >= written);
        assert!(written > 0 && records.len() as i64 == written, "{topic}: {} of {written} records read", records.len());
        late.extend(
            records
                .iter()
                .filter(|record| record.timestamp.is_none_or(|ts| ts < started - BOUND_MS))
                .map(|record| (topic.clone(), record.partition, record.timestamp)),
        );
        read.insert(topic.clone(), records);
    }
    assert_eq!(late, vec![], "records a broker bounding timestamps to an hour would refuse");
    // What the ingester routed carries its input's time: every shard record of
    // increments and every record of graph updates (marks are the ingester's own).
    let routes_increments = |record: &&ReadRecord| {
        let payload = tally_core::wire::packed::unpack(&record.payload).unwrap();
        let sections = tally_core::wire::ShardMessageRef::decode_sections(&payload, 0).unwrap();
        sections.iter().any(|(_, message)| matches!(message, tally_core::wire::ShardMessageRef::Increments { .. }))
    };
    let routes_updates = |record: &&ReadRecord| {
        let message = tally_core::wire::GraphMessage::decode(&record.payload).unwrap();
        matches!(message, tally_core::wire::GraphMessage::Updates { .. })
    };
    let routed =
        (read[&shards].iter().filter(routes_increments)).chain(read[&graph_updates].iter().filter(routes_updates));
    let times: Vec<Option<i64>> = routed
        .map(|record| record.header(tally_core::format::RECORD_TIME_HEADER))
        .map(|value| value.map(|value| tally_core::format::parse_record_time(value).unwrap()))
        .collect();
    assert!(!times.is_empty() && times.iter().all(|time| time.is_some_and(input_time)), "input times {times:?}");
}

/// An ingester tells the records it routes after reading its input to the end (the
/// hint on which a counter closes its batch at the end of a load,
/// `tally.input-drained.v1`) from the ones it routes while records wait behind them:
/// of a backlog, at most the last record of each input partition says so, and the
/// record routed from a message that came alone after the load does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_that_end_an_ingesters_input_say_so() {
    const BACKLOG: usize = 1_200;
    let mut sandbox = Sandbox::start().await;
    let increments = sandbox.names.increments();
    // One entity, so one shard, and a section per input partition and batch; padded
    // to 20 kB, so the broker hands each partition over in several fetches.
    let padding = " ".repeat(20_000);
    let message =
        |i: usize| (Some(format!("k{i}")), format!(r#"{{"entity":"user:1","metric":"m"}}{padding}"#).into_bytes());
    sandbox.produce_to(&increments, &(0..BACKLOG).map(message).collect::<Vec<_>>()).await;
    let ends: Vec<i64> =
        (0..sandbox.partition_count(&increments) as i32).map(|p| sandbox.next_offset(&increments, p)).collect();
    assert_eq!(ends.iter().sum::<i64>(), BACKLOG as i64, "{ends:?}");
    // Batches that close a millisecond after their first record, most before they
    // are full: whether records wait behind them is the broker's to say.
    sandbox.spawn_instance("tally-ingester", "tally-ingester", |config| config.ingester.batch_linger_ms = 1);

    // Each input partition's part of each shard record (a record bundles a batch's
    // partitions, format 4), in order: the input partition, its input offsets,
    // whether the record says drained.
    let read = |sandbox: &Sandbox, entries: usize| -> Vec<(u32, Vec<i64>, bool)> {
        let decoded = |record: &ReadRecord| -> Vec<(u32, Vec<i64>)> {
            let sections = ShardMessage::decode_sections(&record.payload, 0).expect("a shard record");
            let offsets = |(_, message)| match message {
                ShardMessage::Increments { source, entries } => {
                    Some((source.partition, entries.iter().map(|(stamp, _)| stamp.offset).collect::<Vec<_>>()))
                }
                // How far the ingester routed (for write tokens): no increments.
                ShardMessage::Marks { .. } => None,
                other => panic!("not increments: {other:?}"),
            };
            sections.into_iter().filter_map(offsets).collect()
        };
        let routed =
            |records: &[ReadRecord]| records.iter().flat_map(decoded).map(|(_, offsets)| offsets.len()).sum::<usize>();
        let records = sandbox.read_records(&sandbox.names.shards(), Duration::from_secs(60), |r| routed(r) >= entries);
        assert_eq!(routed(&records), entries, "every increment routed once");
        let drained = |record: &ReadRecord| record.headers.iter().any(|key| key == INPUT_DRAINED_HEADER);
        records
            .iter()
            .flat_map(|record| {
                let drained = drained(record);
                decoded(record).into_iter().map(move |(partition, offsets)| (partition, offsets, drained))
            })
            .collect()
    };
    let backlog = read(&sandbox, BACKLOG);
    for (partition, end) in ends.iter().enumerate() {
        let records: Vec<_> = backlog.iter().filter(|record| record.0 == partition as u32).collect();
        let Some((last, before)) = records.split_last() else { continue };
        assert!(before.iter().all(|record| !record.2), "said drained with records behind: {records:?}");
        assert!(!last.2 || last.1.last() == Some(&(end - 1)), "said drained before the end: {records:?}");
    }
    let shape: Vec<_> =
        backlog.iter().map(|(partition, offsets, drained)| (partition, offsets.len(), drained)).collect();
    let behind = backlog.len() - ends.iter().filter(|end| **end > 0).count();
    assert!(behind >= 1, "no record with records behind it, nothing to tell: {shape:?}");

    // One message after the load: its batch read the partition to its end.
    sandbox.produce_to(&increments, &[message(BACKLOG)]).await;
    let after = read(&sandbox, BACKLOG + 1);
    let late: Vec<_> = after.iter().filter(|record| !backlog.contains(record)).collect();
    assert_eq!(late.len(), 1, "{after:?}");
    assert!(late[0].2, "the record that ended the input did not say so: {late:?}");
}

/// Whether an idempotent producer's statistics said it holds its producer id.
#[derive(Default)]
struct ProducerIdState(AtomicBool);

impl ClientContext for ProducerIdState {
    fn stats_raw(&self, statistics: &[u8]) {
        let stats: serde_json::Value = serde_json::from_slice(statistics).unwrap_or_default();
        if stats["eos"]["idemp_state"] == "Assigned" {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

impl ProducerContext for ProducerIdState {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

/// A fresh idempotent producer asked for its id (`request_producer_id`, what the
/// relays, the shard claims and the heartbeats do when created) has it before
/// librdkafka's own retries, 500 ms apart, could have got it: left to them, an
/// ingester's first batch would wait 0.7–0.8 s for the id after it was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_asked_for_its_id_has_it_before_librdkafka_would_retry() {
    let sandbox = Sandbox::start().await;
    let kafka = sandbox.kafka.clone();
    let waited = tokio::task::spawn_blocking(move || {
        let mut config = producer_config(&kafka).unwrap();
        config.set("statistics.interval.ms", "5");
        let created = Instant::now();
        let producer: ThreadedProducer<ProducerIdState> =
            config.create_with_context(ProducerIdState::default()).unwrap();
        request_producer_id(&producer);
        while !producer.context().0.load(Ordering::Relaxed) {
            assert!(created.elapsed() < Duration::from_secs(10), "no producer id in 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        created.elapsed()
    })
    .await
    .unwrap();
    assert!(waited < Duration::from_millis(450), "the producer id came {waited:?} after the producer was created");
}

/// Waits until `service`'s unlabelled metric `family` reads `want`.
async fn wait_for_metric(sandbox: &Sandbox, service: &str, family: &str, want: f64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = sandbox.metric(service, family).await;
        if got == vec![(String::new(), want)] {
            return;
        }
        assert!(Instant::now() < deadline, "{service} {family}: {got:?} after {timeout:?}, want {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An idle ingester, counter and graph rest (their partitions paused: no fetches),
/// and what is written while they rest wakes them and is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_consumers_rest_and_what_comes_next_wakes_them() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_ready(&["tally-graph", "tally-ingester", "tally-counter", "tally-query"]).await;
    let now = tally_shared::kafka::now_ms();
    let before = Workload::generate_mixed(11, 300, now, 0.1);
    sandbox.produce(&before.records).await;
    check::wait_for_all_time(&sandbox, &before.model, &before.entities, &before.metrics, Duration::from_secs(120))
        .await;
    let resting = [
        ("tally-ingester", "tally_ingester_fetch_resting"),
        ("tally-counter", "tally_counter_fetch_resting"),
        ("tally-graph", "tally_graph_fetch_resting"),
    ];
    for (service, gauge) in resting {
        wait_for_metric(&sandbox, service, gauge, 1.0, Duration::from_secs(20)).await;
    }

    // Increments written while all three rest: counted.
    let after = Workload::generate(12, 200, now);
    sandbox.produce(&after.records).await;
    let (model, entities, metrics) = before.then(&after);
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(60)).await;
    for (service, gauge) in resting {
        wait_for_metric(&sandbox, service, gauge, 1.0, Duration::from_secs(20)).await;
    }

    // A graph update written while the ingester and the graph rest: applied.
    let updates = sandbox.metric("tally-graph", "tally_graph_applied_updates_total").await;
    let edge = tally_e2e::workload::Record {
        graph: true,
        key: "user:900".into(),
        payload: br#"{"op":"add_edge","from":"user:900","to":"user:901"}"#.to_vec(),
        timestamp: tally_shared::kafka::now_ms(),
    };
    sandbox.produce(&[edge]).await;
    let applied = updates[0].1 + 1.0;
    wait_for_metric(&sandbox, "tally-graph", "tally_graph_applied_updates_total", applied, Duration::from_secs(30))
        .await;

    // An ingester started again with nothing new to read rests too, and stays at
    // rest: it takes the offsets its group committed for where it stands.
    sandbox.stop("tally-ingester");
    sandbox.spawn_ready(&["tally-ingester"]).await;
    let (ingester, gauge) = ("tally-ingester", "tally_ingester_fetch_resting");
    wait_for_metric(&sandbox, ingester, gauge, 1.0, Duration::from_secs(20)).await;
    for _ in 0..20 {
        assert_eq!(sandbox.metric(ingester, gauge).await, vec![(String::new(), 1.0)], "woke with nothing to read");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

//! Exactly-once under `kill -9`: services killed in the middle of a workload and
//! restarted still end with counts equal to the model — nothing lost, nothing twice.

use std::time::Duration;

use tally_e2e::workload::Workload;
use tally_e2e::{check, Sandbox};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_of_counter_and_ingester_mid_workload_counts_exactly_once() {
    let mut sandbox = Sandbox::start().await;
    for service in ["tally-ingester", "tally-counter", "tally-query"] {
        sandbox.spawn(service);
    }
    let workload = Workload::generate(2, 900, tally_shared::kafka::now_ms());
    let waves: Vec<_> = workload.records.chunks(100).collect();
    for (wave, records) in waves.iter().enumerate() {
        sandbox.produce(records).await;
        tokio::time::sleep(Duration::from_millis(150 + 70 * wave as u64)).await;
        match wave {
            1 | 5 => {
                sandbox.kill9("tally-counter");
                sandbox.spawn("tally-counter");
            }
            3 | 7 => {
                sandbox.kill9("tally-ingester");
                sandbox.spawn("tally-ingester");
            }
            6 => {
                sandbox.kill9("tally-ingester");
                sandbox.kill9("tally-counter");
                sandbox.spawn("tally-counter");
                sandbox.spawn("tally-ingester");
            }
            _ => {}
        }
    }
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(180)).await;
    check::windows(&sandbox, model, entities, metrics).await;
    check::series(&sandbox, model, &entities[..4], metrics).await;
    // The shard topic is kept forever: the stores wrote no WAL, and the counter's
    // kills rolled them back to their last flush, replayed from the log.
    let wal = sandbox.metric("tally-counter", "tally_counter_store_wal").await;
    assert_eq!(wal, vec![(String::new(), 0.0)], "the shard topic is the stores' journal");
}

/// A counter that loses its disk rebuilds every shard from the shard topic, which is
/// kept forever — also across a broker restart (the broker runs its retention sweep
/// on start) — and serves no shard before it caught up: no read ever sees a partial
/// total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_rebuilds_from_the_shard_log_after_losing_its_data() {
    let mut sandbox = Sandbox::start().await;
    let no_snapshots = [("TALLY__SNAPSHOTS__ENABLED", "false".to_string())];
    sandbox.spawn_instance("tally-counter", "tally-counter", &no_snapshots);
    for service in ["tally-ingester", "tally-query"] {
        sandbox.spawn(service);
    }
    let workload = Workload::generate(3, 300, tally_shared::kafka::now_ms());
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;

    sandbox.kill9("tally-counter");
    sandbox.wipe_counter_data();
    sandbox.restart_broker().await;
    sandbox.spawn_instance("tally-counter", "tally-counter", &no_snapshots);
    check::never_partial(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;
}

/// A counter that loses its disk restores every shard from its newest snapshot and
/// replays only the log after it: exact totals, never a partial or older one served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_restores_lost_shards_from_snapshots_and_replays_the_tail() {
    lose_the_counters_disk_and_come_back(Recovery::ByItself).await;
}

/// The same with the snapshots in an S3-compatible object store (moto's server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_restores_lost_shards_from_snapshots_in_s3() {
    lose_the_counters_disk_and_come_back(Recovery::FromS3).await;
}

/// Disaster recovery by an operator: `tally snapshot list` shows every shard's
/// snapshots, `tally restore` puts the newest into an empty data directory, and a
/// counter started on it serves exact totals once it caught up — never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_restores_every_shard_into_an_empty_data_dir() {
    lose_the_counters_disk_and_come_back(Recovery::ByAnOperator).await;
}

#[derive(PartialEq)]
enum Recovery {
    /// The counter restores what it lacks from the local snapshot store.
    ByItself,
    /// The same, from an S3 snapshot store.
    FromS3,
    /// `tally restore` into an empty data directory, then a counter on it.
    ByAnOperator,
}

async fn lose_the_counters_disk_and_come_back(recovery: Recovery) {
    let mut sandbox = Sandbox::start().await;
    let s3 = match recovery {
        Recovery::FromS3 => Some(tally_e2e::s3::S3::start(std::path::PathBuf::from(sandbox.path("moto.log"))).await),
        _ => None,
    };
    let mut snapshots = vec![("TALLY__SNAPSHOTS__INTERVAL_MS", "500".to_string())];
    snapshots.extend(s3.iter().flat_map(|s3| s3.env()));
    sandbox.spawn_instance("tally-counter", "tally-counter", &snapshots);
    for service in ["tally-ingester", "tally-query"] {
        sandbox.spawn(service);
    }
    let now = tally_shared::kafka::now_ms();
    let before = Workload::generate(6, 300, now);
    sandbox.produce(&before.records).await;
    check::wait_for_all_time(&sandbox, &before.model, &before.entities, &before.metrics, Duration::from_secs(120))
        .await;
    // Every shard that holds data has a snapshot of it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let client: rdkafka::consumer::BaseConsumer =
        tally_shared::kafka::client_config(&sandbox.kafka).unwrap().create().unwrap();
    let shard_topic = sandbox.names.shards();
    let shards_with_data = (0..8)
        .filter(|&shard| {
            use rdkafka::consumer::Consumer;
            client.fetch_watermarks(&shard_topic, shard, Duration::from_secs(10)).unwrap().1 > 0
        })
        .count();
    let snapshot_dir = std::path::PathBuf::from(sandbox.path("snapshots")).join(sandbox.names.shards());
    loop {
        let manifests = match &s3 {
            // Shards with a manifest in the bucket: tally/<topic>/shard-NNNN/<id>/MANIFEST.json.
            Some(s3) => {
                let keys = s3.keys().await;
                let shards: std::collections::BTreeSet<&str> = keys
                    .iter()
                    .filter(|key| key.ends_with("/MANIFEST.json") && key.contains(shard_topic.as_str()))
                    .filter_map(|key| key.split('/').nth(2))
                    .collect();
                shards.len()
            }
            None => std::fs::read_dir(&snapshot_dir).map_or(0, |shards| {
                shards
                    .filter_map(Result::ok)
                    .filter(|shard| {
                        std::fs::read_dir(shard.path()).is_ok_and(|mut s| {
                            s.any(|snap| snap.is_ok_and(|snap| snap.path().join("MANIFEST.json").exists()))
                        })
                    })
                    .count()
            }),
        };
        if manifests == shards_with_data {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{manifests} of {shards_with_data} shards snapshot\n{}",
            sandbox.log("tally-counter")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    if recovery == Recovery::ByAnOperator {
        // `tally snapshot`: every serving shard now, waited for.
        let (ok, taken) = sandbox.cli(&["snapshot"]);
        let stored = format!("{shards_with_data} shard snapshots stored, from 1 counters");
        assert!(ok && taken.contains(&stored), "{taken}");
    }
    sandbox.kill9("tally-counter");
    sandbox.wipe_counter_data();
    // The tail: written while the counter is gone, replayed after the restore.
    let after = Workload::generate(7, 200, now);
    sandbox.produce(&after.records).await;
    let (model, entities, metrics) = before.then(&after);
    // Every input routed to the shard topic before the counter comes back, so "caught
    // up with the log" means every total is whole.
    let produced = (before.records.len() + after.records.len()) as f64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let routed = sandbox.metric("tally-ingester", "tally_ingester_input_records_total").await;
        if routed == vec![(String::new(), produced)] {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "routed {routed:?} of {produced}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await; // the routed batch's acknowledgements
    if recovery == Recovery::ByAnOperator {
        let (ok, listed) = sandbox.cli(&["snapshot", "list"]);
        assert!(ok, "{listed}");
        let stores: std::collections::BTreeSet<&str> =
            listed.lines().filter(|l| l.contains("/shard-")).filter_map(|l| l.split_whitespace().next()).collect();
        assert_eq!(stores.len(), shards_with_data, "{listed}");
        let dr = sandbox.path("dr");
        let (ok, output) = sandbox.cli(&["restore", "--into", &dr]);
        assert!(ok, "{output}");
        let (ok, again) = sandbox.cli(&["restore", "--into", &dr]);
        assert!(!ok && again.contains("restore needs an empty data directory"), "{again}");
        let on_dr =
            [("TALLY__COUNTER__DATA_DIR", format!("{dr}/counter")), ("TALLY__SNAPSHOTS__ENABLED", "false".to_string())];
        sandbox.spawn_instance("tally-counter", "tally-counter", &on_dr);
    } else {
        sandbox.spawn_instance("tally-counter", "tally-counter", &snapshots);
    }
    check::never_partial(&sandbox, &model, &entities, &metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
    let restored = sandbox.metric("tally-counter", "tally_counter_restored_shards_total").await;
    let by_itself = if recovery == Recovery::ByAnOperator { 0.0 } else { shards_with_data as f64 };
    assert_eq!(restored, vec![(String::new(), by_itself)], "{}", sandbox.log("tally-counter"));
}

//! Exactly-once under `kill -9`: services killed in the middle of a workload and
//! restarted still end with counts equal to the model — nothing lost, nothing twice.

use std::time::Duration;

use tally_e2e::workload::Workload;
use tally_e2e::{check, Sandbox};
use tally_shared::config::TallyConfig;

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
    let no_snapshots = |config: &mut TallyConfig| config.snapshots.enabled = false;
    sandbox.spawn_instance("tally-counter", "tally-counter", no_snapshots);
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
    sandbox.spawn_instance("tally-counter", "tally-counter", no_snapshots);
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

/// Snapshots in S3 that degrade gracefully: a garbage manifest written beside the
/// good ones is skipped (and marked by `tally snapshot list`), a restore uses the
/// newest good snapshot; with one of its files damaged, the next older one; an upload
/// that never got a manifest is collected. Every count stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_from_s3_pass_over_garbage_and_damaged_snapshots() {
    let mut sandbox = Sandbox::start().await;
    let s3 = tally_e2e::s3::S3::start(std::path::PathBuf::from(sandbox.path("moto.log"))).await;
    sandbox.use_s3(&s3);
    let snapshots = |config: &mut TallyConfig| {
        config.snapshots.interval_ms = 300;
        config.snapshots.keep = 10;
    };
    sandbox.spawn_instance("tally-counter", "tally-counter", snapshots);
    sandbox.spawn_ready(&["tally-ingester", "tally-query"]).await;
    let shard_topic = sandbox.names.shards();
    let shard = tally_core::sharding::shard_of("solo", sandbox.partition_count(&shard_topic));
    let folder = format!("tally/{shard_topic}/shard-{shard:04}");
    // The ids of the shard's snapshots with a manifest, oldest first.
    let snapshot_ids = || async {
        let mut ids: Vec<String> = s3
            .keys()
            .await
            .iter()
            .filter_map(|key| {
                key.strip_prefix(&format!("{folder}/"))?.strip_suffix("/MANIFEST.json").map(str::to_string)
            })
            .collect();
        ids.sort();
        ids
    };
    let mut model = tally_core::model::Model::default();
    let (entities, metrics) = (vec!["solo".to_string()], vec!["views".to_string()]);
    for (delta, snapshots) in [(5, 1), (7, 2)] {
        solo(&sandbox, &mut model, delta).await;
        check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(60)).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while snapshot_ids().await.len() < snapshots {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no snapshot of {folder}\n{}",
                sandbox.log("tally-counter")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let good = snapshot_ids().await;
    assert_eq!(good.len(), 2, "{good:?}");
    // Newer than every good one by its id, and garbage; an upload abandoned long ago.
    s3.put(&format!("{folder}/99999999999999999999-9/MANIFEST.json"), b"{\"v\":1,\"name\":".to_vec()).await;
    let orphan = format!("{folder}/00000000000000000000-1000/000001.sst");
    s3.put(&orphan, b"half an upload".to_vec()).await;
    let (ok, listed) = sandbox.cli(&["snapshot", "list"]);
    assert!(ok, "{listed}");
    let unreadable: Vec<&str> = listed.lines().filter(|l| l.contains("UNREADABLE")).collect();
    assert_eq!(unreadable.len(), 1, "{listed}");
    assert!(unreadable[0].starts_with(&format!("{}/99999999999999999999-9", &folder["tally/".len()..])), "{listed}");

    // Lose the disk: the newest good snapshot is restored, the garbage passed over.
    let restored_from = |sandbox: &Sandbox, id: &str| {
        sandbox.log("tally-counter").lines().any(|l| l.contains("restored from a snapshot") && l.contains(id))
    };
    lose_the_disk(&mut sandbox, &mut model, (11, 3), &snapshots).await;
    assert!(restored_from(&sandbox, &good[1]), "restored {}\n{}", good[1], sandbox.log("tally-counter"));

    // The snapshots now, and the newest damaged: one file changed, its size kept.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while snapshot_ids().await.len() < 4 {
        assert!(tokio::time::Instant::now() < deadline, "no snapshot after the restore");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ids: Vec<String> = snapshot_ids().await.into_iter().filter(|id| !id.starts_with("9999")).collect();
    let (newest, older) = (ids[ids.len() - 1].clone(), ids[ids.len() - 2].clone());
    let (file, size) = s3
        .objects()
        .await
        .into_iter()
        .filter(|(key, _)| key.starts_with(&format!("{folder}/{newest}/")) && !key.ends_with("MANIFEST.json"))
        .max_by_key(|(_, size)| *size)
        .expect("the newest snapshot's files");
    s3.put(&file, vec![0u8; size as usize]).await;
    lose_the_disk(&mut sandbox, &mut model, (13, 4), &snapshots).await;
    let log = sandbox.log("tally-counter");
    assert!(restored_from(&sandbox, &older) && !restored_from(&sandbox, &newest), "restored {older}\n{log}");
    assert!(log.lines().any(|l| l.contains("a snapshot that cannot be restored") && l.contains("SHA-256")), "{log}");
    check::windows(&sandbox, &model, &entities, &metrics).await;
    // The abandoned upload was collected by a prune after a new snapshot.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while s3.keys().await.contains(&orphan) {
        assert!(tokio::time::Instant::now() < deadline, "the abandoned upload stays\n{}", sandbox.log("tally-counter"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One increment of `delta` on `solo`, produced and put in the model.
async fn solo(sandbox: &Sandbox, model: &mut tally_core::model::Model, delta: i64) {
    let now = tally_shared::kafka::now_ms();
    model.apply(tally_core::wire::Increment {
        entity: "solo".into(),
        metric: "views".into(),
        delta,
        ts: now,
        id: None,
    });
    let element = serde_json::json!({"entity": "solo", "metric": "views", "delta": delta, "ts": now});
    sandbox
        .produce_to(&sandbox.names.increments(), &[(Some("solo".to_string()), element.to_string().into_bytes())])
        .await;
}

/// Kills the counter, wipes its disk, produces one more increment of `delta` on
/// `solo` (the `records`-th input record) and brings the counter back: it restores,
/// replays and serves `solo` exactly, never partially.
async fn lose_the_disk(
    sandbox: &mut Sandbox,
    model: &mut tally_core::model::Model,
    (delta, records): (i64, usize),
    change: &dyn Fn(&mut TallyConfig),
) {
    sandbox.kill9("tally-counter");
    sandbox.wipe_counter_data();
    solo(sandbox, model, delta).await;
    routed(sandbox, records).await;
    sandbox.spawn_instance("tally-counter", "tally-counter", change);
    let (entities, metrics) = (["solo".to_string()], ["views".to_string()]);
    check::never_partial(sandbox, model, &entities, &metrics, Duration::from_secs(90)).await;
}

/// Waits until the ingester routed `records` input records (and a moment for their
/// acknowledgements): a counter that comes back then and says it caught up has
/// every one of them.
async fn routed(sandbox: &Sandbox, records: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let routed = sandbox.metric("tally-ingester", "tally_ingester_input_records_total").await;
        if routed == vec![(String::new(), records as f64)] {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "routed {routed:?} of {records}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
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
    if let Some(s3) = &s3 {
        sandbox.use_s3(s3);
    }
    let snapshots = |config: &mut TallyConfig| config.snapshots.interval_ms = 500;
    sandbox.spawn_instance("tally-counter", "tally-counter", snapshots);
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
        sandbox.spawn_instance("tally-counter", "tally-counter", |config| {
            config.counter.data_dir = format!("{dr}/counter").into();
            config.snapshots.enabled = false;
        });
    } else {
        sandbox.spawn_instance("tally-counter", "tally-counter", snapshots);
    }
    check::never_partial(&sandbox, &model, &entities, &metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
    let restored = sandbox.metric("tally-counter", "tally_counter_restored_shards_total").await;
    let by_itself = if recovery == Recovery::ByAnOperator { 0.0 } else { shards_with_data as f64 };
    assert_eq!(restored, vec![(String::new(), by_itself)], "{}", sandbox.log("tally-counter"));
    let restores = sandbox.metric("tally-counter", "tally_counter_restore_seconds_count").await;
    assert_eq!(restores, vec![(String::new(), by_itself)], "each restore timed");
    // Every shard the tail reached waited to catch up with its log (restored or not).
    let caught_up = sandbox.metric("tally-counter", "tally_counter_shard_catch_up_seconds_count").await;
    let timed = caught_up.first().map_or(0.0, |(_, count)| *count);
    assert!((1.0..=shards_with_data as f64).contains(&timed), "{caught_up:?} of {shards_with_data} shards");
}

//! A bounded log: the shard topic keeps records only for its retention. Here it is
//! 3 s, and a broker restart runs the local broker's retention sweep, so every shard
//! record is gone (records are timed by when they were routed). A counter that lost its disk restores every shard from its newest
//! snapshot, which covers the whole log that was deleted, and counts exactly; without
//! a snapshot it refuses the shards that held data, naming why, and answers no read
//! of them — never a partial rebuild.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use tally_e2e::workload::Workload;
use tally_e2e::{check, Sandbox};
use tally_shared::topics::{self, Declarations};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_restores_what_retention_deleted_and_refuses_what_no_snapshot_covers() {
    let mut sandbox = Sandbox::start_without("shards").await;
    let mut declarations = Declarations::load(None).unwrap();
    let shards = declarations.topics.iter_mut().find(|t| t.name == "shards").unwrap();
    shards.retention_ms = Some(3_000);
    topics::apply(&sandbox.kafka, &declarations).await.expect("topics apply");
    for service in ["tally-ingester", "tally-counter", "tally-query"] {
        sandbox.spawn(service);
    }
    let workload = Workload::generate(31, 300, tally_shared::kafka::now_ms());
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    // Records live 3 s, less than a store may wait for a flush: the WAL stays on.
    let wal = sandbox.metric("tally-counter", "tally_counter_store_wal").await;
    assert_eq!(wal, vec![(String::new(), 1.0)], "a 3 s log is no journal");
    let (ok, taken) = sandbox.cli(&["snapshot"]);
    assert!(ok, "{taken}");

    // The disk is lost; retention deletes every shard record.
    let consumer: BaseConsumer = tally_shared::kafka::client_config(&sandbox.kafka).unwrap().create().unwrap();
    let topic = sandbox.names.shards();
    let ends: Vec<i64> =
        (0..8).map(|shard| consumer.fetch_watermarks(&topic, shard, Duration::from_secs(10)).unwrap().1).collect();
    sandbox.stop("tally-counter");
    sandbox.wipe_counter_data();
    tokio::time::sleep(Duration::from_secs(4)).await;
    sandbox.restart_broker().await;
    let left = sandbox.read_topic(&topic, 1, Duration::from_secs(5));
    assert!(ends.iter().any(|end| *end > 0) && left.is_empty(), "{} of {ends:?} records left", left.len());

    // Restored from snapshots: exact.
    sandbox.spawn("tally-counter");
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;

    // No snapshot covers the deleted log: the shards that held data are refused.
    sandbox.stop("tally-counter");
    sandbox.wipe_counter_data();
    std::fs::remove_dir_all(sandbox.path("snapshots")).unwrap();
    sandbox.spawn("tally-counter");
    let with_data: Vec<usize> = (0..8).filter(|&shard| ends[shard] > 0).collect();
    tokio::time::sleep(Duration::from_secs(3)).await; // its admin server starts
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let failures = loop {
        let (status, body) = sandbox.readyz_body("tally-counter").await;
        let failures = body["failures"].as_array().cloned().unwrap_or_default();
        if status == 503 && failures.len() == with_data.len() {
            break failures;
        }
        assert!(std::time::Instant::now() < deadline, "never refused: {status} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for (failure, &shard) in failures.iter().zip(&with_data) {
        // The local broker reports an emptied log as 0..0; the records the group
        // applied before tell it they are gone (a Kafka broker reports the log's new
        // start, which says it too).
        let text = failure.as_str().unwrap_or_default();
        let prefix = format!("shard {shard} failed at offset 0: the log ends at offset 0, but records up to ");
        assert!(text.starts_with(&prefix) && text.contains("they are gone"), "{text}");
    }
    let (status, body) = sandbox
        .post(
            "/v1/query",
            &serde_json::json!({"queries": [
                {"entity": entities[0], "metric": metrics[0], "window": "all"}
            ]}),
        )
        .await;
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("shard_failed")), "{body}");
}

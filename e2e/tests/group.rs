//! Counters as a consumer group: two instances split the shards, `tally-query`
//! finds each shard's owner by itself, and when one instance stops the other takes
//! its shards over, rebuilding them from the shard topic, with exact counts.

use std::time::Duration;

use tally_e2e::workload::Workload;
use tally_e2e::{check, Sandbox};

/// A counter of the group: its own data directory, the membership's assignment.
fn group_member(sandbox: &mut Sandbox, instance: &'static str) {
    let data_dir = sandbox.path(instance);
    sandbox.spawn_instance(instance, "tally-counter", |config| {
        config.counter.static_assignment = false;
        config.counter.data_dir = data_dir.into();
        config.counter.admin_listen = "127.0.0.1:0".into();
    });
}

/// The shards a counter instance announced most recently, from its log.
fn owned_shards(sandbox: &Sandbox, instance: &str) -> Vec<u32> {
    let log = sandbox.log(instance);
    let Some(line) = log.lines().rev().find(|line| line.contains("announcing shard ownership")) else {
        return Vec::new();
    };
    let Some(list) = line.split_once("shards=[").and_then(|(_, rest)| rest.split_once(']')) else {
        return Vec::new();
    };
    list.0.split(',').filter_map(|s| s.trim().parse().ok()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_counters_split_the_shards_and_hand_them_over() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn("tally-ingester");
    sandbox.spawn("tally-query");
    group_member(&mut sandbox, "counter-a");
    group_member(&mut sandbox, "counter-b");

    let before = Workload::generate(4, 150, tally_shared::kafka::now_ms());
    sandbox.produce(&before.records).await;
    let (entities, metrics) = (&before.entities, &before.metrics);
    check::wait_for_all_time(&sandbox, &before.model, entities, metrics, Duration::from_secs(120)).await;

    // Both instances own shards, and together all 8, none twice.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (a, b) = (owned_shards(&sandbox, "counter-a"), owned_shards(&sandbox, "counter-b"));
        let mut all: Vec<u32> = a.iter().chain(&b).copied().collect();
        all.sort();
        if !a.is_empty() && !b.is_empty() && all == (0..8).collect::<Vec<_>>() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "shards not split: a {a:?}, b {b:?}\n{}\n{}",
            sandbox.log("counter-a"),
            sandbox.log("counter-b")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // One instance leaves; the other takes every shard and rebuilds what it lacks.
    sandbox.stop("counter-a");
    let after = Workload::generate(5, 150, tally_shared::kafka::now_ms());
    sandbox.produce(&after.records).await;
    let (model, entities, metrics) = before.then(&after);
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(180)).await;
    check::windows(&sandbox, &model, &entities, &metrics).await;
    assert_eq!(owned_shards(&sandbox, "counter-b"), (0..8).collect::<Vec<_>>(), "{}", sandbox.log("counter-b"));
}

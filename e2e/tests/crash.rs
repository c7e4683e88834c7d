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
}

/// A counter that loses its disk rebuilds every shard from the shard topic, which is
/// kept forever — also across a broker restart (the broker runs its retention sweep
/// on start) — and serves no shard before it caught up: no read ever sees a partial
/// total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_rebuilds_from_the_shard_log_after_losing_its_data() {
    let mut sandbox = Sandbox::start().await;
    for service in ["tally-ingester", "tally-counter", "tally-query"] {
        sandbox.spawn(service);
    }
    let workload = Workload::generate(3, 300, tally_shared::kafka::now_ms());
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;

    sandbox.kill9("tally-counter");
    sandbox.wipe_counter_data();
    sandbox.restart_broker().await;
    sandbox.spawn("tally-counter");
    check::never_partial(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    check::windows(&sandbox, model, entities, metrics).await;
}

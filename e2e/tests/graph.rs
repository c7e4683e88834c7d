//! Hierarchical totals end to end: increments and graph updates (chains, diamonds,
//! cycles, removals, re-adds, retried ids, bad elements) through Kafka; every total
//! and direct over HTTP equals the model on the final graph — also when the graph
//! processor and a counter are killed with -9 in the middle.

use std::time::Duration;

use tally_e2e::workload::Workload;
use tally_e2e::{check, encode, Sandbox};

const SERVICES: [&str; 4] = ["tally-ingester", "tally-counter", "tally-graph", "tally-query"];

/// The neighbours the read API lists for `entity`, two per page.
async fn neighbours(sandbox: &Sandbox, entity: &str, direction: &str) -> Vec<String> {
    let base = format!("/v1/graph/{}?direction={direction}&limit=2", encode(entity));
    let pages = check::pages::<serde_json::Value>(sandbox, &base).await.unwrap_or_else(|failure| panic!("{failure}"));
    pages
        .iter()
        .flat_map(|(_, body)| body["entities"].as_array().unwrap().iter())
        .map(|e| e.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_follow_the_graph_and_match_the_model() {
    let mut sandbox = Sandbox::start().await;
    // The checks read at once: every service answers first (on a busy machine the
    // query service was not listening yet when the first read came).
    sandbox.spawn_ready(&SERVICES).await;
    let workload = Workload::generate_mixed(11, 500, tally_shared::kafka::now_ms(), 0.2);
    assert!(workload.model.edges().len() > 5, "the workload builds a graph");
    sandbox.produce(&workload.records).await;

    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(180)).await;
    check::windows(&sandbox, model, entities, metrics).await;
    check::series(&sandbox, model, &entities[..6], metrics).await;
    check::listings(&sandbox, model, entities).await;
    let plan = tally_core::time::Plan { resolution: None, start: 0, step: 0, points: 1, to: 0 };
    let explained = entities.iter().filter(|e| !model.contributors(e, &metrics[0], &plan).is_empty()).count();
    assert!(explained > 3, "the workload gives totals with contributors ({explained})");
    check::contributors(&sandbox, model, entities, metrics).await;
    // A model with one more increment on an entity that reaches others must disagree.
    let (origin, _) = model.edges().iter().next().expect("an edge").clone();
    let mut wrong = model.clone();
    let event = model.events().iter().find(|e| e.entity == origin).cloned();
    let mut extra = event.unwrap_or_else(|| model.events()[0].clone());
    extra.entity = origin;
    extra.id = None;
    wrong.apply(extra);
    assert!(check::try_contributors(&sandbox, &wrong, entities, metrics).await.is_err(), "contributors can fail");

    for entity in entities {
        let out: Vec<String> = model.edges().iter().filter(|(f, _)| f == entity).map(|(_, t)| t.clone()).collect();
        let inn: Vec<String> = model.edges().iter().filter(|(_, t)| t == entity).map(|(f, _)| f.clone()).collect();
        let mut inn_sorted = inn.clone();
        inn_sorted.sort();
        assert_eq!(neighbours(&sandbox, entity, "descendants").await, out, "{entity} descendants");
        assert_eq!(neighbours(&sandbox, entity, "ancestors").await, inn_sorted, "{entity} ancestors");
    }

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), workload.rejections + 1, Duration::from_secs(20));
    assert_eq!(letters.len(), workload.rejections, "every rejection, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_and_lost_disk_of_graph_and_kill9_of_counter_mid_workload_count_exactly_once() {
    let mut sandbox = Sandbox::start().await;
    for service in SERVICES {
        sandbox.spawn(service);
    }
    let workload = Workload::generate_mixed(12, 800, tally_shared::kafka::now_ms(), 0.2);
    let waves: Vec<_> = workload.records.chunks(100).collect();
    for (wave, records) in waves.iter().enumerate() {
        sandbox.produce(records).await;
        tokio::time::sleep(Duration::from_millis(200 + 80 * wave as u64)).await;
        match wave {
            1 | 5 => {
                sandbox.kill9("tally-graph");
                sandbox.spawn("tally-graph");
            }
            2 => {
                // A lost disk, no snapshots: the graph rebuilds from the whole log
                // and emits the same stamps, which the counters drop.
                sandbox.kill9("tally-graph");
                sandbox.wipe_graph_data();
                sandbox.spawn_instance("tally-graph", "tally-graph", |config| config.snapshots.enabled = false);
            }
            3 => {
                sandbox.kill9("tally-counter");
                sandbox.spawn("tally-counter");
            }
            4 => {
                // A lost disk again: the graph restores its newest snapshot and
                // replays the log after it. The graph that ran since wave 2 takes
                // none, and on a slow machine the ones before it may have applied
                // nothing yet: then one with snapshots stores the first.
                if !sandbox.log("tally-graph").contains("snapshot stored") {
                    sandbox.kill9("tally-graph");
                    sandbox.spawn("tally-graph");
                    let deadline = std::time::Instant::now() + Duration::from_secs(60);
                    while !sandbox.log("tally-graph").contains("snapshot stored") {
                        let waited = std::time::Instant::now() < deadline;
                        assert!(waited, "no graph snapshot within 60 s:\n{}", sandbox.log("tally-graph"));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                sandbox.kill9("tally-graph");
                sandbox.wipe_graph_data();
                sandbox.spawn("tally-graph");
            }
            6 => {
                // An operator's `tally snapshot` covers the graph too (once the
                // restarted graph caught up and claims its read address again).
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    let (ok, taken) = sandbox.cli(&["snapshot"]);
                    if ok && taken.contains("\n1 graph snapshot stored") {
                        break;
                    }
                    assert!(std::time::Instant::now() < deadline, "{taken}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                sandbox.kill9("tally-graph");
                sandbox.kill9("tally-counter");
                sandbox.spawn("tally-counter");
                sandbox.spawn("tally-graph");
            }
            _ => {}
        }
    }
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(240)).await;
    check::windows(&sandbox, model, entities, metrics).await;
    let log = sandbox.log("tally-graph");
    assert!(log.contains("restored from a snapshot"), "the second lost disk was restored from a snapshot:\n{log}");
}

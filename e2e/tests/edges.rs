//! Nothing lost at the edges: records too big for the broker, an outbox batch
//! bigger than one record, a stale lease after a partition comes back, delayed jobs
//! that fill a buffer, a dead job too big for one record, a retry applied after a
//! long backlog, rollups after a kill -9.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use tally_core::jobs::api::MAX_ERROR_BYTES;
use tally_core::jobs::DeadJob;
use tally_core::model::Model;
use tally_core::wire::{DeadLetter, Increment, Rollup};
use tally_e2e::{check, encode, Sandbox};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::now_ms;

/// Reads the dead letters (up to `at_most`, waiting up to 10 s for them) and decodes them.
fn dead_letters(sandbox: &Sandbox, at_most: usize) -> Vec<DeadLetter> {
    sandbox
        .read_topic(&sandbox.names.dead_letter(), at_most, Duration::from_secs(10))
        .iter()
        .map(|raw| serde_json::from_slice(raw).expect("dead letters are JSON"))
        .collect()
}

/// Waits until `probe` holds, polling; panics with `what` after `timeout`.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !probe().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An 800 KB message that is not JSON, and 2 000 graph updates with long names in
/// one ingester batch (~1.3 MB of graph-updates entries): the bad message is
/// dead-lettered once (its payload cut to fit, and the letter says so), the updates
/// travel in several records, and every increment after them is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_too_big_for_the_broker_never_stall_ingestion() {
    let mut sandbox = Sandbox::start().await;
    let garbage = vec![b'z'; 800_000];
    sandbox.produce_to(&sandbox.names.increments(), &[(Some("big".into()), garbage)]).await;
    let long = |prefix: &str, i: usize| format!("{prefix}{i}-{}", "a".repeat(240));
    let updates: Vec<(Option<String>, Vec<u8>)> = (0..2)
        .map(|half| {
            let batch: Vec<Value> = (half * 1_000..(half + 1) * 1_000)
                .map(|i| json!({"op": "add_edge", "from": long("from", i), "to": long("to", i), "id": format!("g-{i}-{}", "i".repeat(100))}))
                .collect();
            (Some("same-partition".to_string()), serde_json::to_vec(&batch).unwrap())
        })
        .collect();
    sandbox.produce_to(&sandbox.names.graph(), &updates).await;
    let workload = tally_e2e::workload::Workload::generate(11, 200, now_ms());
    sandbox.produce(&workload.records).await;
    // Everything is in the topics before the ingester starts: one batch holds it all.
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-graph", "tally-query"]).await;

    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    eventually("the graph holds the 2 000 edges", Duration::from_secs(60), || async {
        sandbox.metric("tally-graph", "tally_graph_edges").await == vec![(String::new(), 2_000.0)]
    })
    .await;
    let (status, body) =
        sandbox.get(&format!("/v1/graph/{}?direction=descendants", encode(&long("from", 1_999)))).await;
    assert_eq!((status, &body["entities"]), (200, &json!([long("to", 1_999)])), "{body}");

    let letters = dead_letters(&sandbox, workload.rejections + 2);
    assert_eq!(letters.len(), workload.rejections + 1, "every rejection once, the big one too");
    let big: Vec<&DeadLetter> = letters.iter().filter(|l| !l.truncated.is_empty()).collect();
    assert_eq!(big.len(), 1, "one letter for the 800 KB message");
    assert_eq!(big[0].truncated, BTreeMap::from([("payload".to_string(), 800_000)]));
    assert!(!big[0].reason.is_empty());
    let kept = base64::engine::general_purpose::STANDARD.decode(&big[0].payload).unwrap();
    assert!(kept.len() > 600_000 && kept.iter().all(|b| *b == b'z'), "{} bytes kept", kept.len());
}

/// An origin with hundreds of retained buckets gains 200 descendants with long
/// names at once: the totals it sends the other shards are several megabytes, more
/// than one record holds. Every descendant's total and windows equal the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_outbox_batch_reaches_every_shard() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-graph", "tally-query"]).await;
    let now = now_ms();
    let mut model = Model::default();
    // One view a minute for the last 5 h 50 min: 350 one-minute buckets, 6 hours, 1-2 days.
    let increments: Vec<Value> = (0..350)
        .map(|minute| {
            let ts = now - minute * 60_000;
            model.apply(Increment { entity: "origin".into(), metric: "views".into(), delta: 1, ts, id: None });
            json!({"entity": "origin", "metric": "views", "ts": ts})
        })
        .collect();
    sandbox
        .produce_to(&sandbox.names.increments(), &[(Some("origin".into()), serde_json::to_vec(&increments).unwrap())])
        .await;
    let origin = vec!["origin".to_string()];
    let views = vec!["views".to_string()];
    check::wait_for_all_time(&sandbox, &model, &origin, &views, Duration::from_secs(60)).await;

    let descendants: Vec<String> = (0..200).map(|i| format!("descendant-{i:03}-{}", "d".repeat(110))).collect();
    let edges: Vec<Value> = descendants.iter().map(|d| json!({"op": "add_edge", "from": "origin", "to": d})).collect();
    for d in &descendants {
        model.apply_edge(true, "origin", d, None);
    }
    sandbox.produce_to(&sandbox.names.graph(), &[(Some("origin".into()), serde_json::to_vec(&edges).unwrap())]).await;

    check::wait_for_all_time(&sandbox, &model, &descendants, &views, Duration::from_secs(120)).await;
    check::windows(&sandbox, &model, &descendants[..20], &views).await;
    let relayed = sandbox.metric("tally-counter", "tally_counter_outbox_relayed_total").await;
    assert!(relayed[0].1 > 7.0, "the totals went out in more records than shards: {relayed:?}");
}

/// Dequeues up to `max` jobs from a broker (none while it does not answer yet).
async fn dequeue(broker: &str, queue: &str, max: usize) -> Vec<Value> {
    let body = json!({"max": max, "wait_ms": 500, "lease_ms": 600_000});
    let sent = reqwest::Client::new().post(format!("{broker}/v1/queues/{queue}/dequeue")).json(&body).send().await;
    let Ok(response) = sent else {
        tokio::time::sleep(Duration::from_millis(200)).await;
        return Vec::new(); // not listening yet
    };
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("dequeue JSON");
    body["jobs"].as_array().cloned().unwrap_or_default()
}

/// Dequeues until `n` jobs came (within a minute).
async fn dequeue_n(broker: &str, queue: &str, n: usize) -> Vec<Value> {
    let started = std::time::Instant::now();
    let mut jobs = Vec::new();
    while jobs.len() < n {
        assert!(started.elapsed() < Duration::from_secs(60), "{broker} handed out {} of {n} jobs", jobs.len());
        jobs.extend(dequeue(broker, queue, n - jobs.len()).await);
    }
    jobs
}

/// The all-time value of counter e/m.
async fn value(sandbox: &Sandbox) -> Option<i64> {
    sandbox.get("/v1/counters/e/m?window=all").await.1["value"].as_i64()
}

async fn post(url: String, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new().post(url).json(&body).send().await.expect("POST");
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// A queue's stats on a broker (null while it does not answer yet).
async fn stats(broker: &str, queue: &str) -> Value {
    match reqwest::get(format!("{broker}/v1/queues/{queue}")).await {
        Ok(response) => response.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// The partitions a broker serves now, from its stats.
async fn served(broker: &str, queue: &str) -> BTreeSet<i64> {
    let stats = stats(broker, queue).await;
    stats["partitions"]
        .as_array()
        .map(|ps| ps.iter().filter(|p| p["owned_here"] == true).filter_map(|p| p["partition"].as_i64()).collect())
        .unwrap_or_default()
}

/// A broker lets partitions go to a second broker and takes them back when it
/// leaves: the leases it handed out before are unknown now — an ack with one of
/// them never finishes the job that runs under a new lease of the same number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_retaking_a_partition_rejects_a_stale_lease() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare("[[queue]]\nname = \"retake\"\npartitions = 16\nlease_ms = 600000\n").await;
    let jobs: Vec<(Option<String>, Vec<u8>)> = (0..320)
        .map(|i| (Some(format!("key-{i}")), json!({"id": format!("j{i}"), "payload": i}).to_string().into_bytes()))
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("retake"), &jobs).await;
    let a = sandbox.spawn_broker("broker-a", &declarations);
    let all: BTreeSet<i64> = (0..16).collect();
    eventually("broker A serves every partition", Duration::from_secs(60), || async {
        served(&a, "retake").await == all
    })
    .await;
    let first = dequeue_n(&a, "retake", 320).await;

    let b = sandbox.spawn_broker("broker-b", &declarations);
    eventually("broker B takes some partitions", Duration::from_secs(60), || async {
        !served(&b, "retake").await.is_empty() && served(&a, "retake").await.len() < 16
    })
    .await;
    let moved: BTreeSet<i64> = all.difference(&served(&a, "retake").await).copied().collect();
    sandbox.stop("broker-b");
    eventually("broker A serves every partition again", Duration::from_secs(60), || async {
        served(&a, "retake").await == all
    })
    .await;

    // The moved partitions were fetched again from their committed offsets and their
    // jobs handed out under new leases.
    let partition_of =
        |job: &Value| -> i64 { job["lease"].as_str().unwrap().split('.').next().unwrap().parse().unwrap() };
    let stale: Vec<String> = first
        .iter()
        .filter(|j| moved.contains(&partition_of(j)))
        .map(|j| j["lease"].as_str().unwrap().into())
        .collect();
    assert!(!stale.is_empty());
    let again = dequeue_n(&a, "retake", stale.len()).await;
    assert!(again.iter().all(|j| moved.contains(&partition_of(j))), "only the moved partitions run again");

    let (status, body) = post(format!("{a}/v1/queues/retake/ack"), json!({"leases": stale})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"acked": 0, "unknown": stale}), "stale leases are unknown");
    assert_eq!(stats(&a, "retake").await["in_flight"], json!(320), "every job still runs under its lease");
    let current: Vec<String> = again.iter().map(|j| j["lease"].as_str().unwrap().to_string()).collect();
    let (_, body) = post(format!("{a}/v1/queues/retake/ack"), json!({"leases": current})).await;
    assert_eq!(body["acked"], json!(again.len()), "{body}");
}

/// 10 000 jobs due in ten minutes fill a partition's buffer; a ready job enqueued
/// after them runs at once. A job delayed beyond what the topic keeps is refused
/// with a reason instead of being lost to retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_delayed_jobs_do_not_delay_a_ready_one() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare("[[queue]]\nname = \"later\"\npartitions = 1\nbuffer = 10000\n").await;
    let due = now_ms() + 600_000;
    let mut jobs: Vec<(Option<String>, Vec<u8>)> = (0..10_000)
        .map(|i| {
            (Some("k".into()), json!({"id": format!("d{i}"), "payload": i, "run_at": due}).to_string().into_bytes())
        })
        .collect();
    let too_far = now_ms() + 30 * 86_400_000;
    jobs.push((Some("k".into()), json!({"id": "far", "payload": 0, "run_at": too_far}).to_string().into_bytes()));
    jobs.push((Some("k".into()), json!({"id": "ready", "payload": 1}).to_string().into_bytes()));
    sandbox.produce_to(&sandbox.names.jobs("later"), &jobs).await;
    let broker = sandbox.spawn_broker("broker", &declarations);

    let started = std::time::Instant::now();
    let mut handed = Vec::new();
    while handed.is_empty() && started.elapsed() < Duration::from_secs(30) {
        if let Ok(response) = reqwest::Client::new()
            .post(format!("{broker}/v1/queues/later/dequeue"))
            .json(&json!({"max": 10, "wait_ms": 1000}))
            .send()
            .await
        {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            handed = body["jobs"].as_array().cloned().unwrap_or_default();
        }
    }
    let ids: Vec<&str> = handed.iter().filter_map(|j| j["id"].as_str()).collect();
    assert_eq!(ids, vec!["ready"], "the ready job runs, none of the delayed ones");
    let stats = stats(&broker, "later").await;
    assert_eq!((stats["delayed"].clone(), stats["in_flight"].clone()), (json!(10_000), json!(1)), "{stats}");

    let letters = dead_letters(&sandbox, 2);
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((letters[0].topic.as_str(), letters[0].offset), (sandbox.names.jobs("later").as_str(), 10_000));
    assert!(letters[0].reason.starts_with("run_at: "), "{}", letters[0].reason);
}

/// A job whose dead record (a 950 KB payload and the longest error a nack may
/// carry) is over the broker's limit still lands in `.dead` — its error cut, and the record says so —
/// and the partition moves past it; an oversized malformed job's dead letter is
/// written (cut) before the partition's offset passes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_megabyte_dead_job_lands_in_dead() {
    let mut sandbox = Sandbox::start().await;
    let declarations =
        sandbox.declare("[[queue]]\nname = \"big\"\npartitions = 1\nmax_attempts = 1\nlease_ms = 600000\n").await;
    let payload = "p".repeat(950_000);
    let job = json!({"id": "huge", "payload": {"blob": payload}}).to_string().into_bytes();
    let malformed = vec![b'#'; 900_000];
    let after = json!({"id": "after", "payload": 1}).to_string().into_bytes();
    let records = [(Some("k".to_string()), job), (Some("k".to_string()), malformed), (Some("k".to_string()), after)];
    sandbox.produce_to(&sandbox.names.jobs("big"), &records).await;
    let broker = sandbox.spawn_broker("broker", &declarations);

    let started = std::time::Instant::now();
    let mut huge = Vec::new();
    while huge.is_empty() && started.elapsed() < Duration::from_secs(60) {
        huge = dequeue(&broker, "big", 1).await;
    }
    assert_eq!(huge.first().map(|j| j["id"].clone()), Some(json!("huge")));
    let error = "e".repeat(MAX_ERROR_BYTES + 1);
    let (status, body) =
        post(format!("{broker}/v1/queues/big/nack"), json!({"lease": huge[0]["lease"], "error": error})).await;
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("error_too_long")), "{body}");
    let (status, body) = post(
        format!("{broker}/v1/queues/big/nack"),
        json!({"lease": huge[0]["lease"], "error": &error[..MAX_ERROR_BYTES]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let dead = sandbox.read_topic(&sandbox.names.dead_jobs("big"), 1, Duration::from_secs(60));
    assert_eq!(dead.len(), 1, "the dead job is in .dead");
    let dead: DeadJob = serde_json::from_slice(&dead[0]).unwrap();
    assert_eq!((dead.job.id.as_str(), dead.attempts), ("huge", 1));
    assert_eq!(dead.job.payload.get(), json!({"blob": payload}).to_string(), "the job is whole");
    assert_eq!(dead.truncated, BTreeMap::from([("error".to_string(), MAX_ERROR_BYTES)]));
    assert!(dead.error.len() > 10_000 && dead.error.bytes().all(|b| b == b'e'));

    let letters = dead_letters(&sandbox, 1);
    assert_eq!(letters.len(), 1);
    assert_eq!((letters[0].offset, letters[0].truncated.get("payload")), (1, Some(&900_000)));
    let next = dequeue(&broker, "big", 1).await;
    assert_eq!(next.iter().map(|j| j["id"].clone()).collect::<Vec<_>>(), vec![json!("after")]);
    let (_, body) = post(format!("{broker}/v1/queues/big/ack"), json!({"leases": [next[0]["lease"]]})).await;
    assert_eq!(body["acked"], 1);
    eventually("the partition's offset passes every finished job", Duration::from_secs(30), || async {
        let group = format!("{}broker", sandbox.names.name(""));
        sandbox.committed_offset(&group, &sandbox.names.jobs("big"), 0) == Some(3)
    })
    .await;
}

/// The dedupe window runs on the records' time: a retry produced 3 s after its
/// original, applied 13 s later (the counter was down) with a 10 s window, is
/// still a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_applied_after_a_long_backlog_counts_once() {
    let mut sandbox = Sandbox::start().await;
    let window = |config: &mut TallyConfig| config.counting.dedupe_window = "10s".into();
    sandbox.spawn_instance("tally-ingester", "tally-ingester", window);
    sandbox.spawn_instance("tally-counter", "tally-counter", window);
    sandbox.spawn_ready(&["tally-query"]).await;
    let increment =
        |id: &str| (Some("e".to_string()), json!({"entity": "e", "metric": "m", "id": id}).to_string().into_bytes());
    let original_at = std::time::Instant::now();
    sandbox.produce_to(&sandbox.names.increments(), &[increment("x")]).await;
    eventually("the original is counted", Duration::from_secs(60), || async { value(&sandbox).await == Some(1) }).await;

    sandbox.stop("tally-counter");
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(original_at.elapsed())).await;
    sandbox.produce_to(&sandbox.names.increments(), &[increment("x"), increment("y")]).await;
    tokio::time::sleep(Duration::from_secs(13).saturating_sub(original_at.elapsed())).await;
    sandbox.spawn_instance("tally-counter", "tally-counter", window);
    eventually("the new id is counted", Duration::from_secs(60), || async { value(&sandbox).await >= Some(2) }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(value(&sandbox).await, Some(2), "the retry counts once");
}

/// Rollups are delivered at least once after every commit: a counter that commits
/// a batch and is killed with -9 before its rollups reach the broker publishes them
/// when it comes back, with nothing new to apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill9_after_a_commit_still_leaves_the_right_final_rollup() {
    let mut sandbox = Sandbox::start_without("rollups").await;
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-query"]).await;
    let workload = tally_e2e::workload::Workload::generate(5, 60, now_ms());
    sandbox.produce(&workload.records).await;
    let (model, entities, metrics) = (&workload.model, &workload.entities, &workload.metrics);
    // Counted and committed; the rollups cannot be delivered: their topic is missing.
    check::wait_for_all_time(&sandbox, model, entities, metrics, Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    sandbox.kill9("tally-counter");
    sandbox.apply_topics().await;
    sandbox.spawn("tally-counter");

    let expected: usize = entities.iter().map(|e| model.metrics(e).len()).sum();
    let mut latest: BTreeMap<(String, String), Rollup> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while latest.len() < expected && tokio::time::Instant::now() < deadline {
        let rollups = sandbox.latest_rollups(Duration::from_secs(3));
        latest = rollups
            .live()
            .filter(|(_, rollup)| rollup.resolution == "all")
            .map(|(_, rollup)| ((rollup.entity.clone(), rollup.metric.clone()), rollup.clone()))
            .collect();
    }
    let want: BTreeMap<(String, String), (i128, i128)> = entities
        .iter()
        .flat_map(|e| model.metrics(e).into_iter().map(move |(m, (direct, total))| ((e.clone(), m), (total, direct))))
        .collect();
    let got: BTreeMap<(String, String), (i128, i128)> =
        latest.into_iter().map(|(key, rollup)| (key, (rollup.total, rollup.direct))).collect();
    assert_eq!(got, want, "the latest all-time rollup of every counter");
}

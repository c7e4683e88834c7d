//! Cancelling jobs end to end: two real brokers, the worker library and the CLI.
//! Waiting and delayed jobs cancelled never run; running ones stop within one
//! heartbeat; a job cancelled before it is enqueued never runs either; every
//! cancelled job ends on the dead topic as cancelled, and runs when requeued; an
//! unknown job is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::jobs::api::DequeuedJob;
use tally_core::jobs::partition::CANCELLED;
use tally_core::jobs::DeadJob;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tally_shared::kafka::now_ms;
use tokio_util::sync::CancellationToken;

const QUEUE: &str = r#"
[[queue]]
name = "cancels"
partitions = 2
lease_ms = 2000
"#;

const RUNNING: usize = 20;
const WAITING: usize = 100;

/// What the worker saw: when each job started, and when a long one stopped.
#[derive(Default)]
struct Seen {
    started: BTreeMap<String, Instant>,
    stopped: BTreeMap<String, Instant>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_jobs_never_run_and_running_ones_stop_within_a_heartbeat() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUE).await;
    let a = sandbox.spawn_broker("broker-a", &declarations);
    let b = sandbox.spawn_broker("broker-b", &declarations);
    sandbox.config.broker.listen = a.trim_start_matches("http://").to_string();
    // Each sees itself in the membership: the partitions move only once, as both join.
    sandbox.wait_ready("broker-a", Duration::from_secs(60)).await;
    sandbox.wait_ready("broker-b", Duration::from_secs(60)).await;
    let later = now_ms() + 12_000;
    let mut records = Vec::new();
    for i in 0..RUNNING {
        records.push((Some(format!("long{i}")), format!(r#"{{"id":"long{i}","payload":{{}}}}"#).into_bytes()));
    }
    for i in 0..WAITING {
        let job = format!(r#"{{"id":"later{i}","payload":{{}},"run_at":{later}}}"#);
        records.push((Some(format!("later{i}")), job.into_bytes()));
    }
    sandbox.produce_to(&sandbox.names.jobs("cancels"), &records).await;

    let seen: Arc<Mutex<Seen>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |job: DequeuedJob, stop: CancellationToken| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().started.insert(job.id.clone(), Instant::now());
                if job.id.starts_with("long") {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(Duration::from_secs(120)) => {}
                    }
                    seen.lock().unwrap().stopped.insert(job.id.clone(), Instant::now());
                }
                Outcome::Ack
            }
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: vec![a.clone(), b.clone()],
        queue: "cancels".into(),
        concurrency: RUNNING + 5,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let running = tokio::spawn(worker::run_stoppable(options, handler, shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().started.len() < RUNNING {
        assert!(Instant::now() < deadline, "the long jobs never all started:\n{}", sandbox.log("broker-a"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // ...an unknown job is refused, saying why; the CLI says the same.
    let http = reqwest::Client::new();
    let cancel = |base: &str, id: &str| {
        http.post(format!("{base}/v1/queues/cancels/cancel")).json(&serde_json::json!({ "id": id })).send()
    };
    // Once the owners hold every job (the long ones running, the others waiting for
    // their time, or ready once it came): nothing is left to fetch...
    let held = |base: String| async move {
        let stats: serde_json::Value =
            reqwest::get(format!("{base}/v1/queues/cancels")).await.ok()?.json().await.ok()?;
        let every = stats["partitions"].as_array()?;
        let owned: Vec<&serde_json::Value> = every.iter().filter(|p| p["owned_here"] == true).collect();
        let jobs: Option<u64> =
            owned.iter().map(|p| Some(p["ready"].as_u64()? + p["delayed"].as_u64()? + p["in_flight"].as_u64()?)).sum();
        let partitions: BTreeSet<u64> = owned.iter().filter_map(|p| p["partition"].as_u64()).collect();
        let owners: Vec<String> = every.iter().map(|p| p["owner"].to_string()).collect();
        Some((jobs?, partitions, owners))
    };
    // Both brokers name the same owner of each partition, each partition is served by
    // one of them (none changing owner), and they hold every job between them.
    let settled = |a: &(u64, BTreeSet<u64>, Vec<String>), b: &(u64, BTreeSet<u64>, Vec<String>)| {
        let every: BTreeSet<u64> = (0..a.2.len() as u64).collect();
        a.0 + b.0 == (RUNNING + WAITING) as u64
            && a.2 == b.2
            && a.1.is_disjoint(&b.1)
            && a.1.union(&b.1).copied().collect::<BTreeSet<u64>>() == every
    };
    let mut holding = (held(a.clone()).await, held(b.clone()).await);
    while !holding.0.as_ref().zip(holding.1.as_ref()).is_some_and(|(a, b)| settled(a, b)) {
        assert!(
            Instant::now() < deadline,
            "the brokers never held every job: {holding:?}\nbroker-a:\n{}\nbroker-b:\n{}",
            sandbox.log("broker-a"),
            sandbox.log("broker-b")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        holding = (held(a.clone()).await, held(b.clone()).await);
    }
    // Garbage and oversized requests are refused, saying why.
    let garbage = http.post(format!("{a}/v1/queues/cancels/cancel")).body("not json").send().await.unwrap();
    let (status, body) = (garbage.status().as_u16(), garbage.json::<serde_json::Value>().await.unwrap());
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_body")), "{body}");
    let oversized = cancel(&a, &"x".repeat(300)).await.unwrap();
    let (status, body) = (oversized.status().as_u16(), oversized.json::<serde_json::Value>().await.unwrap());
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_id")), "{body}");
    // The running-jobs listing takes a bounded limit, and nothing else.
    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("limit=ten", "invalid_parameter"),
        ("colour=red", "invalid_parameter"),
    ] {
        let listing = http.get(format!("{a}/v1/queues/cancels/running?{query}")).send().await.unwrap();
        let (status, body) = (listing.status().as_u16(), listing.json::<serde_json::Value>().await.unwrap());
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some(code)), "{query}: {body}");
    }
    let unknown = cancel(&a, "never-enqueued").await.unwrap();
    let status = unknown.status().as_u16();
    let body: serde_json::Value = unknown.json().await.unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("unknown_job")), "{body}");
    let (ok, out) = sandbox.cli(&["jobs", "cancel", "cancels", "never-enqueued-either"]);
    assert!(!ok && out.contains("no job \"never-enqueued-either\" waits or runs on queue cancels"), "{out}");

    // The waiting ones: some by the CLI, the rest by the API of either broker.
    let mut answers = BTreeMap::new();
    for i in 0..WAITING {
        let id = format!("later{i}");
        if i < 5 {
            let (ok, out) = sandbox.cli(&["jobs", "cancel", "cancels", &id]);
            let logs = || format!("broker-a:\n{}\nbroker-b:\n{}", sandbox.log("broker-a"), sandbox.log("broker-b"));
            assert!(ok && out.contains(&format!("cancelled {id} on cancels: it will not run")), "{out}\n{}", logs());
            continue;
        }
        let response = cancel(if i % 2 == 0 { &a } else { &b }, &id).await.unwrap();
        let body: serde_json::Value = response.json().await.unwrap();
        answers.insert(id, body["was"].as_str().map(str::to_string));
    }
    assert!(answers.values().all(|was| was.as_deref() == Some("waiting")), "{answers:?}");
    // The running ones, timed from each answer.
    let mut cancelled_at = BTreeMap::new();
    for i in 0..RUNNING {
        let id = format!("long{i}");
        let response = cancel(&b, &id).await.unwrap();
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["was"], "running", "{body}");
        cancelled_at.insert(id, Instant::now());
    }
    // A job cancelled before it is enqueued never runs.
    let early = cancel(&a, "early").await.unwrap();
    assert_eq!(early.status().as_u16(), 404, "no broker holds it yet, nor has anything to fetch");
    sandbox
        .produce_to(
            &sandbox.names.jobs("cancels"),
            &[(Some("early".into()), br#"{"id":"early","payload":{}}"#.to_vec())],
        )
        .await;

    // Every running one stops within one heartbeat (half the lease) and a margin.
    let heartbeat = Duration::from_millis(1_000);
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.lock().unwrap().stopped.len() < RUNNING && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let late: Vec<(String, Option<Duration>)> = cancelled_at
        .iter()
        .map(|(id, at)| (id.clone(), seen.lock().unwrap().stopped.get(id).map(|stopped| stopped.duration_since(*at))))
        .filter(|(_, took)| took.is_none_or(|took| took > heartbeat + Duration::from_millis(1_500)))
        .collect();
    assert!(late.is_empty(), "running jobs that did not stop within a heartbeat: {late:?}");

    // Past the waiting ones' time: none of them (nor `early`) ever ran.
    while now_ms() < later + 3_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    running.await.unwrap().expect("the worker stops cleanly");
    let ran: Vec<String> = seen.lock().unwrap().started.keys().filter(|id| !id.starts_with("long")).cloned().collect();
    assert!(ran.is_empty(), "cancelled jobs ran: {ran:?}");

    // Each cancelled job is on the dead topic as cancelled, once.
    let letters =
        sandbox.read_topic(&sandbox.names.dead_jobs("cancels"), RUNNING + WAITING + 1, Duration::from_secs(30));
    let dead: Vec<DeadJob> = letters.iter().map(|bytes| DeadJob::decode(bytes).unwrap()).collect();
    assert!(dead.iter().all(|job| job.error == CANCELLED), "{:?}", dead.iter().map(|j| &j.error).collect::<Vec<_>>());
    let ids: BTreeSet<String> = dead.iter().map(|job| job.job.id.clone()).collect();
    let mut expected: BTreeSet<String> = (0..RUNNING).map(|i| format!("long{i}")).collect();
    expected.extend((0..WAITING).map(|i| format!("later{i}")));
    expected.insert("early".into());
    assert_eq!((ids, dead.len()), (expected, RUNNING + WAITING + 1));

    // A cancelled job requeued runs (its cancellation is revoked first); the
    // others stay cancelled.
    let requeued: BTreeSet<String> =
        dead.iter().map(|job| job.job.id.clone()).filter(|id| id == "early" || id.starts_with("later1")).collect();
    let places: Vec<serde_json::Value> = dead
        .iter()
        .filter(|job| requeued.contains(&job.job.id))
        .map(|job| serde_json::json!({"partition": job.partition, "offset": job.offset}))
        .collect();
    let response = http
        .post(format!("{a}/v1/queues/cancels/dead/requeue"))
        .json(&serde_json::json!({ "jobs": places }))
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["requeued"], requeued.len(), "{body}");
    let ran: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let handler = {
        let ran = ran.clone();
        move |job: DequeuedJob| {
            let ran = ran.clone();
            async move {
                ran.lock().unwrap().insert(job.id);
                Outcome::Ack
            }
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: vec![a.clone(), b.clone()],
        queue: "cancels".into(),
        concurrency: 4,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let again = tokio::spawn(worker::run(options, handler, shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while ran.lock().unwrap().len() < requeued.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    shutdown.cancel();
    again.await.unwrap().expect("the worker stops cleanly");
    assert_eq!(*ran.lock().unwrap(), requeued, "the requeued jobs ran, and only they");
}

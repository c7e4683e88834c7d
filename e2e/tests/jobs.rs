//! Job queues end to end: real brokers, the worker library, a real Kafka-protocol
//! broker. Every job completes at least once and none is lost — with nacks, leases
//! that expire, jobs that die after `max_attempts`, delays, FIFO keys, rate limits,
//! malformed jobs, and a broker killed with -9.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::jobs::api::DequeuedJob;
use tally_core::jobs::DeadJob;
use tally_core::wire::DeadLetter;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tally_shared::kafka::now_ms;
use tokio_util::sync::CancellationToken;

const QUEUES: &str = r#"
[[queue]]
name = "work"
partitions = 4
max_attempts = 3
backoff_ms = 50
backoff_max_ms = 200
lease_ms = 1000
buffer = 500

[[queue]]
name = "ordered"
partitions = 2
fifo = true
backoff_ms = 50
lease_ms = 2000

[[queue]]
name = "limited"
partitions = 2
rate_limit_per_sec = 200

[[queue]]
name = "later"
partitions = 2
"#;

/// The last lines of a log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn job(id: &str, payload: serde_json::Value, run_at: Option<i64>, key: Option<&str>) -> (Option<String>, Vec<u8>) {
    let mut job = serde_json::json!({"id": id, "payload": payload});
    if let Some(at) = run_at {
        job["run_at"] = at.into();
    }
    if let Some(key) = key {
        job["key"] = key.into();
    }
    (key.map(str::to_string).or_else(|| Some(id.to_string())), job.to_string().into_bytes())
}

/// Runs a worker on `queue` until `done` says so (or `timeout`), then stops it.
async fn work_until<H, F>(
    brokers: Vec<String>,
    queue: &str,
    concurrency: usize,
    handler: H,
    done: impl Fn() -> bool,
    timeout: Duration,
) where
    H: Fn(DequeuedJob) -> F + Send + Sync + 'static,
    F: std::future::Future<Output = Outcome> + Send + 'static,
{
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers,
        queue: queue.into(),
        concurrency,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let running = tokio::spawn(worker::run(options, handler, shutdown.clone()));
    let deadline = Instant::now() + timeout;
    while !done() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    running.await.unwrap().expect("the workers stop cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_runs_at_least_once_with_nacks_timeouts_and_dead_jobs() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let brokers =
        vec![sandbox.spawn_broker("broker-a", &declarations), sandbox.spawn_broker("broker-b", &declarations)];

    const JOBS: usize = 20_000;
    let mut records: Vec<(Option<String>, Vec<u8>)> =
        (0..JOBS).map(|i| job(&format!("j{i}"), serde_json::json!({"n": i}), None, None)).collect();
    let malformed = [b"not json".to_vec(), br#"{"payload":1}"#.to_vec(), br#"{"id":"","payload":1}"#.to_vec()];
    records.extend(malformed.iter().map(|bad| (None, bad.clone())));
    sandbox.produce_to(&sandbox.names.jobs("work"), &records).await;

    // j%97 always fails (dead after 3 attempts); j%10 fails its first attempt; j%13
    // is abandoned on its first attempt (the lease expires and it runs again).
    let always_fails = |n: usize| n.is_multiple_of(97);
    let done: Arc<Mutex<HashMap<usize, u32>>> = Arc::default();
    let handler_done = done.clone();
    let handler = move |job: DequeuedJob| {
        let done = handler_done.clone();
        async move {
            let n: usize = job.id[1..].parse().unwrap();
            if always_fails(n) {
                return Outcome::Retry { in_ms: None, error: format!("job {n} always fails") };
            }
            if job.attempt == 1 && n.is_multiple_of(10) {
                return Outcome::Retry { in_ms: Some(20), error: "first attempt fails".into() };
            }
            if job.attempt == 1 && n.is_multiple_of(13) {
                return Outcome::Abandon;
            }
            *done.lock().unwrap().entry(n).or_default() += 1;
            Outcome::Ack
        }
    };
    let expected_done = (0..JOBS).filter(|n| !always_fails(*n)).count();
    let finished = done.clone();
    work_until(
        brokers,
        "work",
        64,
        handler,
        move || finished.lock().unwrap().len() >= expected_done,
        Duration::from_secs(240),
    )
    .await;

    let done = done.lock().unwrap();
    let missing: Vec<usize> = (0..JOBS).filter(|n| !always_fails(*n) && !done.contains_key(n)).take(10).collect();
    assert!(
        missing.is_empty(),
        "{} of {expected_done} done; missing e.g. {missing:?}\n--- broker-a ---\n{}\n--- broker-b ---\n{}",
        done.len(),
        tail(&sandbox.log("broker-a")),
        tail(&sandbox.log("broker-b"))
    );
    assert!(!(0..JOBS).any(|n| always_fails(n) && done.contains_key(&n)));

    let dead_expected = (0..JOBS).filter(|n| always_fails(*n)).count();
    let dead = sandbox.read_topic(&sandbox.names.dead_jobs("work"), dead_expected, Duration::from_secs(30));
    let dead: Vec<DeadJob> = dead.iter().map(|raw| serde_json::from_slice(raw).expect("dead jobs are JSON")).collect();
    let dead_ids: HashSet<String> = dead.iter().map(|d| d.job.id.clone()).collect();
    assert_eq!(dead_ids.len(), dead_expected, "every always-failing job is dead");
    assert!(dead.iter().all(|d| d.attempts == 3 && d.error.contains("always fails")), "{:?}", dead.first());

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), malformed.len(), Duration::from_secs(20));
    let letters: Vec<DeadLetter> = letters.iter().map(|raw| serde_json::from_slice(raw).unwrap()).collect();
    assert_eq!(letters.len(), malformed.len(), "malformed jobs go to the dead letters");
    assert!(letters.iter().all(|l| l.topic == sandbox.names.jobs("work") && !l.reason.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delays_fifo_order_and_rate_limits_hold() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let brokers =
        vec![sandbox.spawn_broker("broker-a", &declarations), sandbox.spawn_broker("broker-b", &declarations)];

    // Delayed jobs never run before run_at.
    let now = now_ms();
    let delayed: Vec<_> = (0..200)
        .map(|i| job(&format!("d{i}"), serde_json::json!(i), Some(now + 1_000 + (i as i64 % 20) * 150), None))
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("later"), &delayed).await;
    let early: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen: Arc<Mutex<HashSet<String>>> = Arc::default();
    let (early_h, seen_h) = (early.clone(), seen.clone());
    let handler = move |job: DequeuedJob| {
        let (early, seen) = (early_h.clone(), seen_h.clone());
        async move {
            let i: i64 = job.id[1..].parse().unwrap();
            if now_ms() < now + 1_000 + (i % 20) * 150 {
                early.lock().unwrap().push(job.id.clone());
            }
            seen.lock().unwrap().insert(job.id);
            Outcome::Ack
        }
    };
    let seen_all = seen.clone();
    work_until(
        brokers.clone(),
        "later",
        16,
        handler,
        move || seen_all.lock().unwrap().len() >= 200,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(seen.lock().unwrap().len(), 200);
    assert!(early.lock().unwrap().is_empty(), "ran before run_at: {:?}", early.lock().unwrap());

    // FIFO: one job of a key at a time, in order, also across retries.
    let keys = 20;
    let per_key = 40;
    let ordered: Vec<_> = (0..per_key)
        .flat_map(|seq| (0..keys).map(move |k| (k, seq)))
        .map(|(k, seq)| {
            job(&format!("o{k}-{seq}"), serde_json::json!({"key": k, "seq": seq}), None, Some(&format!("key{k}")))
        })
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("ordered"), &ordered).await;
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let progress: Arc<Mutex<HashMap<u64, i64>>> = Arc::default();
    let running: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let (violations_h, progress_h, running_h) = (violations.clone(), progress.clone(), running.clone());
    let handler = move |job: DequeuedJob| {
        let (violations, progress, running) = (violations_h.clone(), progress_h.clone(), running_h.clone());
        async move {
            let payload: serde_json::Value = serde_json::from_str(job.payload.get()).unwrap();
            let (key, seq) = (payload["key"].as_u64().unwrap(), payload["seq"].as_i64().unwrap());
            if !running.lock().unwrap().insert(key) {
                violations.lock().unwrap().push(format!("key{key} ran twice at once"));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            running.lock().unwrap().remove(&key);
            if job.attempt == 1 && seq % 7 == 3 {
                return Outcome::Retry { in_ms: Some(10), error: "retry keeps the order".into() };
            }
            let mut progress = progress.lock().unwrap();
            let last = progress.entry(key).or_insert(-1);
            if seq != *last + 1 {
                violations.lock().unwrap().push(format!("key{key}: {seq} after {last}"));
            }
            *last = seq;
            Outcome::Ack
        }
    };
    let progress_all = progress.clone();
    let all_done = move || progress_all.lock().unwrap().values().filter(|s| **s == per_key as i64 - 1).count() == keys;
    work_until(brokers.clone(), "ordered", 32, handler, all_done, Duration::from_secs(120)).await;
    assert!(violations.lock().unwrap().is_empty(), "{:?}", &violations.lock().unwrap()[..]);
    assert_eq!(progress.lock().unwrap().len(), keys);

    // Rate limit: 200/s over all brokers, within 10 %.
    let limited: Vec<_> = (0..1_500).map(|i| job(&format!("r{i}"), serde_json::json!(i), None, None)).collect();
    sandbox.produce_to(&sandbox.names.jobs("limited"), &limited).await;
    let times: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let times_h = times.clone();
    let handler = move |_job: DequeuedJob| {
        let times = times_h.clone();
        async move {
            times.lock().unwrap().push(Instant::now());
            Outcome::Ack
        }
    };
    let times_all = times.clone();
    work_until(
        brokers,
        "limited",
        64,
        handler,
        move || times_all.lock().unwrap().len() >= 1_500,
        Duration::from_secs(60),
    )
    .await;
    let times = times.lock().unwrap();
    assert_eq!(times.len(), 1_500);
    // Skip the first second (the buckets start full); measure the steady rate.
    let start = times[0] + Duration::from_secs(1);
    let steady: Vec<&Instant> = times.iter().filter(|t| **t >= start).collect();
    let span = steady.last().unwrap().duration_since(*steady[0]).as_secs_f64();
    let rate = steady.len() as f64 / span;
    assert!((150.0..=220.0).contains(&rate), "{rate:.0} jobs/s for a limit of 200/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_mid_run_loses_no_job() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let brokers =
        vec![sandbox.spawn_broker("broker-a", &declarations), sandbox.spawn_broker("broker-b", &declarations)];
    const JOBS: usize = 5_000;
    let records: Vec<_> = (0..JOBS).map(|i| job(&format!("k{i}"), serde_json::json!(i), None, None)).collect();
    sandbox.produce_to(&sandbox.names.jobs("work"), &records).await;

    let done: Arc<Mutex<HashSet<usize>>> = Arc::default();
    let done_h = done.clone();
    let handler = move |job: DequeuedJob| {
        let done = done_h.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            done.lock().unwrap().insert(job.id[1..].parse().unwrap());
            Outcome::Ack
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: brokers.clone(),
        queue: "work".into(),
        concurrency: 16,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let running = tokio::spawn(worker::run(options, handler, shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.lock().unwrap().len() < JOBS / 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(done.lock().unwrap().len() >= JOBS / 3, "the run got going");
    sandbox.kill9("broker-a");
    let deadline = Instant::now() + Duration::from_secs(120);
    while done.lock().unwrap().len() < JOBS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    running.await.unwrap().expect("the workers stop cleanly");
    let done = done.lock().unwrap();
    let missing: Vec<usize> = (0..JOBS).filter(|n| !done.contains(n)).take(10).collect();
    assert!(
        missing.is_empty(),
        "{} of {JOBS} done after the kill; missing e.g. {missing:?}\n{}",
        done.len(),
        sandbox.log("broker-b")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generic_worker_runs_jobs_with_a_command() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let broker = sandbox.spawn_broker("broker-a", &declarations);
    let out = sandbox.path("ran");
    std::fs::create_dir_all(&out).unwrap();
    // Each job writes its payload to a file named after the job; job "c7" fails once.
    let script = format!(
        r#"if [ "$TALLY_JOB_ID" = c7 ] && [ "$TALLY_JOB_ATTEMPT" = 1 ]; then echo flaky >&2; exit 1; fi; cat > {out}/$TALLY_JOB_ID"#
    );
    sandbox.spawn_instance("worker", "tally-worker", |config| {
        config.worker.brokers = vec![broker.clone()];
        config.worker.queue = "work".into();
        config.worker.command = Some(vec!["sh".into(), "-c".into(), script]);
        config.worker.admin_listen = "127.0.0.1:0".into();
    });
    let records: Vec<_> = (0..50).map(|i| job(&format!("c{i}"), serde_json::json!({"n": i}), None, None)).collect();
    sandbox.produce_to(&sandbox.names.jobs("work"), &records).await;
    // A job's file exists from the moment `cat` opens it: wait for every payload
    // written whole, not just for 50 files (a file read while `cat` still ran was
    // empty once).
    let payload = |i: usize| format!(r#"{{"n":{i}}}"#);
    let all_written = || (0..50).all(|i| std::fs::read_to_string(format!("{out}/c{i}")).is_ok_and(|w| w == payload(i)));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !all_written() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in 0..50 {
        let written = std::fs::read_to_string(format!("{out}/c{i}"))
            .unwrap_or_else(|_| panic!("job c{i} never ran\n{}", tail(&sandbox.log("worker"))));
        assert_eq!(written, payload(i));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_enqueues_shows_stats_and_requeues_dead_jobs() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let broker = sandbox.spawn_broker("broker-a", &declarations);
    for i in 0..3 {
        let (ok, out) = sandbox.cli(&[
            "jobs",
            "enqueue",
            "work",
            &format!(r#"{{"n":{i}}}"#),
            "--id",
            &format!("cli{i}"),
            "--key",
            "k",
        ]);
        assert!(ok, "{out}");
    }
    let (ok, out) = sandbox.cli(&["jobs", "enqueue", "work", "not json"]);
    assert!(!ok && out.contains("JSON"), "{out}");

    // Every attempt fails: after 3 attempts each job is dead.
    let failures: Arc<Mutex<usize>> = Arc::default();
    let counted = failures.clone();
    let handler = move |_job: DequeuedJob| {
        let failures = counted.clone();
        async move {
            *failures.lock().unwrap() += 1;
            Outcome::Retry { in_ms: Some(10), error: "no luck".into() }
        }
    };
    let seen = failures.clone();
    work_until(vec![broker.clone()], "work", 4, handler, move || *seen.lock().unwrap() >= 9, Duration::from_secs(60))
        .await;

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut listed = String::new();
    while Instant::now() < deadline {
        let (ok, out) = sandbox.cli(&["jobs", "dead", "work"]);
        assert!(ok, "{out}");
        listed = out;
        if listed.contains("3 dead jobs") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(listed.contains("3 dead jobs") && listed.contains("no luck"), "{listed}");
    let (ok, out) = sandbox.cli(&["jobs", "stats", "work", "--broker", &broker]);
    assert!(ok && out.contains("work"), "{out}");
    let (ok, out) = sandbox.cli(&["jobs", "dead", "work", "--requeue"]);
    assert!(ok && out.contains("requeued 3"), "{out}");
    let (ok, out) = sandbox.cli(&["jobs", "dead", "work"]);
    assert!(ok && out.lines().any(|l| l.starts_with("0 dead jobs on work")), "requeued jobs leave the list: {out}");

    // The requeued jobs run again.
    let ran: Arc<Mutex<HashSet<String>>> = Arc::default();
    let ran_h = ran.clone();
    let handler = move |job: DequeuedJob| {
        let ran = ran_h.clone();
        async move {
            ran.lock().unwrap().insert(job.id);
            Outcome::Ack
        }
    };
    let ran_all = ran.clone();
    work_until(vec![broker], "work", 4, handler, move || ran_all.lock().unwrap().len() >= 3, Duration::from_secs(30))
        .await;
    assert_eq!(ran.lock().unwrap().len(), 3);
}

const RANKED: &str = r#"
[[queue]]
name = "ranked"
partitions = 1
priority_levels = 3
"#;

/// A job of `ranked` at `level` (none: the default, the lowest).
fn ranked(id: &str, level: Option<u8>) -> (Option<String>, Vec<u8>) {
    let mut job = serde_json::json!({"id": id, "payload": {"id": id}});
    if let Some(level) = level {
        job["priority"] = level.into();
    }
    (Some(id.to_string()), job.to_string().into_bytes())
}

/// A job of a higher level goes before a backlog of lower ones; one of the lowest
/// level waits its turn behind them; one past the queue's levels is refused by the
/// CLI and dead-lettered by the broker, each saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_job_is_handed_out_before_a_backlog_of_low_ones() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(RANKED).await;
    sandbox.config.broker.declarations = Some(declarations.clone());
    let broker = sandbox.spawn_broker("broker-a", &declarations);
    let (ok, out) = sandbox.cli(&["jobs", "enqueue", "ranked", "{}", "--priority", "3"]);
    assert!(!ok && out.contains("queue ranked: priority: 3 is past the queue's levels (0 to 2)"), "{out}");

    let mut records: Vec<_> = (0..200).map(|i| ranked(&format!("low{i}"), None)).collect();
    records.extend([ranked("high", Some(2)), ranked("late", Some(0)), ranked("past", Some(3))]);
    sandbox.produce_to(&sandbox.names.jobs("ranked"), &records).await;
    let held = || async {
        let stats: serde_json::Value =
            reqwest::get(format!("{broker}/v1/queues/ranked")).await.ok()?.json().await.ok()?;
        stats["partitions"][0]["ready"].as_u64()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while held().await != Some(202) {
        assert!(Instant::now() < deadline, "the broker never held the 202 jobs:\n{}", tail(&sandbox.log("broker-a")));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let response = reqwest::Client::new()
        .post(format!("{broker}/v1/queues/ranked/dequeue"))
        .json(&serde_json::json!({"max": 3}))
        .send()
        .await
        .unwrap();
    let handed: tally_core::jobs::api::DequeueResponse = response.json().await.unwrap();
    let order: Vec<(&str, Option<u8>)> = handed.jobs.iter().map(|j| (j.id.as_str(), j.priority)).collect();
    assert_eq!(order, vec![("high", Some(2)), ("low0", None), ("low1", None)]);

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), 1, Duration::from_secs(20));
    let letter: DeadLetter = serde_json::from_slice(&letters[0]).unwrap();
    assert_eq!(letter.reason, "priority: 3 is past the queue's levels (0 to 2)");
}

const HEALTH: &str = r#"
[[queue]]
name = "health"
partitions = 1
backoff_ms = 60000
backoff_max_ms = 60000
"#;

/// What an operator watches: the age of the oldest ready job (the API's and the
/// Prometheus gauge's, within the test's own clock) and the jobs waiting to retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_health_shows_the_oldest_ready_age_and_the_retrying_jobs() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(HEALTH).await;
    let admin = format!("127.0.0.1:{}", tally_shared::local_broker::free_port().unwrap());
    let admin_listen = admin.clone();
    let broker =
        sandbox.spawn_broker_with("broker-a", &declarations, |config| config.broker.admin_listen = admin_listen);
    let produced = Instant::now();
    let records: Vec<_> = ["h0", "h1", "h2"].iter().map(|id| job(id, serde_json::json!({}), None, None)).collect();
    sandbox.produce_to(&sandbox.names.jobs("health"), &records).await;
    let client = tally_jobs_client::BrokerClient::new("health", None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.stats(&broker).await.map_or(0, |s| s.partitions[0].ready) < 3 {
        assert!(Instant::now() < deadline, "the broker never held the jobs:\n{}", tail(&sandbox.log("broker-a")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // One attempt fails: it waits a minute for its retry.
    let handed = client.dequeue(&broker, 1, None, 0).await.unwrap();
    client.nack(&broker, &handed[0].lease, None, "not yet").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    let stats = client.stats(&broker).await.unwrap();
    let (age, waited) = (stats.oldest_ready_age_ms.expect("an age"), produced.elapsed().as_millis() as i64);
    assert!((1_500..=waited).contains(&age), "oldest ready age {age} ms, the test waited {waited} ms");
    let counts = (stats.partitions[0].ready, stats.delayed, stats.retrying, stats.in_flight);
    assert_eq!(counts, (2, 1, 1, 0), "ready, delayed, retrying, in flight");
    // The gauge is refreshed every second.
    let gauge = || async {
        let text = reqwest::get(format!("http://{admin}/metrics")).await.unwrap().text().await.unwrap();
        let line = text.lines().find(|l| l.starts_with("tally_jobs_oldest_ready_age_seconds{queue=\"health\"}"));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let seconds = loop {
        match gauge().await {
            Some(seconds) if seconds >= 1.5 => break seconds,
            _ => assert!(Instant::now() < deadline, "the gauge never showed the age"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(seconds <= produced.elapsed().as_secs_f64(), "gauge {seconds} s");

    // Nothing ready: no age.
    let rest = client.dequeue(&broker, 2, None, 0).await.unwrap();
    assert_eq!(rest.len(), 2);
    assert_eq!(client.stats(&broker).await.unwrap().oldest_ready_age_ms, None);
}

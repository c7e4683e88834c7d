//! Concurrency limits end to end: real brokers killed with -9 and started again,
//! workers that nack and crash, and an outside observer that records when each job
//! runs — never more than a key's limit, nor the queue's total, at any moment; and
//! a queue that drops a busy key's new jobs instead (`at_limit = "drop_newest"`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tally_core::jobs::api::DequeuedJob;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tokio_util::sync::CancellationToken;

const LIMITED: &str = r#"
[[queue]]
name = "tenants"
partitions = 4
lease_ms = 3000
max_lease_ms = 3500
max_attempts = 1000
backoff_ms = 20
backoff_max_ms = 100

[queue.limits]
per_key = 1
total = 20
key_field = "tenant"

[[queue.limits.overrides]]
pattern = "wide-*"
per_key = 3
"#;

const JOBS: usize = 10_000;
const KEYS: usize = 1_000;
const TOTAL: usize = 20;

/// When a job ran, as its handler saw it: from its start to its end (a handler
/// stopped by the worker library ends when it is dropped).
struct Run {
    key: String,
    start: Instant,
    end: Option<Instant>,
}

type Runs = Arc<Mutex<Vec<Run>>>;

/// Records the end of a run when dropped, whether the handler finished or was stopped.
struct Running {
    runs: Runs,
    index: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.runs.lock().unwrap()[self.index].end = Some(Instant::now());
    }
}

/// The most runs at once over all keys, and the worst key's most at once against
/// its limit: `(total, [(key, most, limit)] over their limit)`.
fn most_at_once(runs: &[Run], limit_of: impl Fn(&str) -> usize) -> (usize, Vec<(String, usize, usize)>) {
    // Ends before starts at the same instant: a slot freed may be taken at once.
    let mut events: Vec<(Instant, i32, &str)> = Vec::new();
    for run in runs {
        events.push((run.start, 1, &run.key));
        events.push((run.end.expect("every run ended"), -1, &run.key));
    }
    events.sort_by_key(|(at, delta, _)| (*at, *delta));
    let (mut total, mut most) = (0i64, 0i64);
    let mut per_key: std::collections::HashMap<&str, (i64, i64)> = std::collections::HashMap::new();
    for (_, delta, key) in events {
        total += i64::from(delta);
        most = most.max(total);
        let (now, worst) = per_key.entry(key).or_default();
        *now += i64::from(delta);
        *worst = (*worst).max(*now);
    }
    let mut over: Vec<(String, usize, usize)> = per_key
        .into_iter()
        .filter(|(key, (_, worst))| *worst as usize > limit_of(key))
        .map(|(key, (_, worst))| (key.to_string(), worst as usize, limit_of(key)))
        .collect();
    over.sort();
    (most as usize, over)
}

fn limit_of(key: &str) -> usize {
    if key.starts_with("wide-") {
        3
    } else {
        1
    }
}

#[test]
fn the_observer_sees_overlaps_when_there_are_some() {
    let at = Instant::now();
    let ms = |n: u64| at + Duration::from_millis(n);
    let run = |key: &str, start, end| Run { key: key.into(), start: ms(start), end: Some(ms(end)) };
    let runs = vec![run("a", 0, 10), run("a", 10, 20), run("b", 5, 15), run("a", 15, 25), run("wide-1", 0, 30)];
    assert_eq!(most_at_once(&runs, limit_of), (3, vec![("a".to_string(), 2, 1)]));
    let back_to_back = vec![run("a", 0, 10), run("a", 10, 20)];
    assert_eq!(most_at_once(&back_to_back, limit_of), (1, vec![]));
}

/// Per-key limit 1 (3 for `wide-*` keys) and a total of 20 over 10 000 jobs on 1 000
/// keys, produced anywhere (the brokers forward each to its key's partition), with
/// three brokers of which one (not the first) is killed -9 and started again three times (a few
/// jobs outlive the time a dead broker's partitions take to move, so its leases
/// still run when they do), and workers that nack some jobs and abandon others:
/// 0 moments over either limit, and every job done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_through_broker_kills_and_every_job_is_done() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(LIMITED).await;
    const BROKERS: [&str; 3] = ["broker-a", "broker-b", "broker-c"];
    // Brokers that notice a death quickly: well within a lease.
    let quick = |config: &mut tally_shared::config::TallyConfig| {
        config.broker.heartbeat_ms = 200;
        config.broker.member_timeout_ms = 1_000;
    };
    let mut urls: Vec<String> =
        BROKERS.iter().map(|name| sandbox.spawn_broker_with(name, &declarations, quick)).collect();
    let mut rng = rand::rng();
    let records: Vec<_> = (0..JOBS)
        .map(|i| {
            let key = match i % KEYS {
                k if k < 10 => format!("wide-{k}"),
                k => format!("t{k}"),
            };
            let job = serde_json::json!({"id": format!("j{i}"), "payload": {"tenant": key, "n": i}});
            (Some(format!("j{i}")), job.to_string().into_bytes())
        })
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("tenants"), &records).await;

    let runs: Runs = Arc::default();
    let done: Arc<Mutex<std::collections::HashSet<usize>>> = Arc::default();
    let handler = {
        let (runs, done) = (runs.clone(), done.clone());
        move |job: DequeuedJob| {
            let (runs, done) = (runs.clone(), done.clone());
            async move {
                let key = job.concurrency_key.clone().expect("the broker names the key");
                let index = {
                    let mut runs = runs.lock().unwrap();
                    runs.push(Run { key, start: Instant::now(), end: None });
                    runs.len() - 1
                };
                let running = Running { runs: runs.clone(), index };
                // A few run longer than a broker takes to be declared dead, so a
                // killed broker's jobs still run when their partition is taken.
                let (work, fate) = {
                    let mut rng = rand::rng();
                    let work = if rng.random_ratio(1, 200) {
                        rng.random_range(4_000..5_000)
                    } else {
                        rng.random_range(1..8u64)
                    };
                    (work, rng.random_range(0..100u32))
                };
                tokio::time::sleep(Duration::from_millis(work)).await;
                drop(running);
                match fate {
                    0..4 => Outcome::Retry { in_ms: Some(10), error: "a nack".into() },
                    4..6 => Outcome::Abandon,
                    _ => {
                        done.lock().unwrap().insert(job.id[1..].parse().unwrap());
                        Outcome::Ack
                    }
                }
            }
        }
    };
    let shutdown = CancellationToken::new();
    let mut workers = Vec::new();
    for _ in 0..2 {
        let options = WorkerOptions {
            brokers: urls.clone(),
            queue: "tenants".into(),
            concurrency: 16,
            lease_ms: None,
            auth_token: None,
            stop_grace_ms: 1_000,
            spans: None,
        };
        workers.push(tokio::spawn(worker::run(options, handler.clone(), shutdown.clone())));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let progress = || done.lock().unwrap().len();
    for kill in 0..3 {
        let target = (kill + 1) * JOBS / 5;
        while progress() < target && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Never the first: the workers found the brokers through the ones started
        // first, and a restarted broker listens elsewhere.
        let victim = BROKERS[rng.random_range(1..BROKERS.len())];
        sandbox.kill9(victim);
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_500))).await;
        urls.push(sandbox.spawn_broker_with(victim, &declarations, quick));
    }
    while progress() < JOBS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    for running in workers {
        running.await.unwrap().expect("the workers stop cleanly");
    }
    let missing: Vec<usize> = (0..JOBS).filter(|n| !done.lock().unwrap().contains(n)).take(10).collect();
    let logs = || BROKERS.iter().map(|name| sandbox.log(name)).collect::<Vec<_>>().join("\n");
    assert!(missing.is_empty(), "{} of {JOBS} done; missing e.g. {missing:?}\n{}", progress(), logs());
    let runs = runs.lock().unwrap();
    let (most, over) = most_at_once(&runs, limit_of);
    assert!(most <= TOTAL && over.is_empty(), "{most} at once (limit {TOTAL}); keys over their limit: {over:?}");
    assert!(runs.len() >= JOBS, "{} runs", runs.len());
    let logs = logs();
    let holds = logs.lines().filter(|line| line.contains("holding a limited partition")).count();
    assert!(holds >= 3, "each kill moves partitions, which are held: {holds} holds");
}

const DROPPING: &str = r#"
[[queue]]
name = "dropping"
partitions = 2
lease_ms = 2000
max_lease_ms = 3000

[queue.limits]
per_key = 1
key_field = "tenant"
at_limit = "drop_newest"
"#;

/// `at_limit = "drop_newest"` on a real broker: while a tenant's job runs, its new
/// jobs go to the dead topic as dropped, never run; other tenants' jobs and the
/// tenant's next job once it is free run; the broker counts what it dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_jobs_of_a_busy_key_are_dropped_when_declared() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(DROPPING).await;
    let mut admin = String::new();
    let broker = sandbox.spawn_broker_with("broker-a", &declarations, |config| {
        admin = config.broker.admin_listen.clone();
    });
    let topic = sandbox.names.jobs("dropping");
    let job = |id: &str, tenant: &str| {
        let body = serde_json::json!({"id": id, "payload": {"tenant": tenant}});
        (Some(id.to_string()), body.to_string().into_bytes())
    };
    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (ran, release) = (ran.clone(), release.clone());
        move |job: DequeuedJob| {
            let (ran, release) = (ran.clone(), release.clone());
            async move {
                ran.lock().unwrap().push(job.id.clone());
                if job.id == "slow" {
                    release.notified().await;
                }
                Outcome::Ack
            }
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: vec![broker],
        queue: "dropping".into(),
        concurrency: 4,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let workers = tokio::spawn(worker::run(options, handler, shutdown.clone()));
    // Taken partitions of a limited queue wait out max_lease_ms first.
    sandbox.produce_to(&topic, &[job("slow", "acme")]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ran.lock().unwrap().contains(&"slow".to_string()) {
        assert!(Instant::now() < deadline, "the slow job never ran:\n{}", sandbox.log("broker-a"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dropped: Vec<String> = (0..5).map(|i| format!("acme-{i}")).collect();
    let mut records: Vec<_> = dropped.iter().map(|id| job(id, "acme")).collect();
    records.push(job("other", "globex"));
    sandbox.produce_to(&topic, &records).await;
    let dead = sandbox.read_topic(&sandbox.names.dead_jobs("dropping"), dropped.len(), Duration::from_secs(30));
    let mut letters: Vec<(String, String)> = dead
        .iter()
        .map(|bytes| {
            let dead = tally_core::jobs::DeadJob::decode(bytes).unwrap();
            (dead.job.id, dead.error)
        })
        .collect();
    letters.sort();
    let why = "dropped: its concurrency key \"acme\" had 1 jobs in flight, its limit (the queue's limits.at_limit = \"drop_newest\")";
    assert_eq!(letters, dropped.iter().map(|id| (id.clone(), why.to_string())).collect::<Vec<_>>());
    // Free again, the tenant's next job runs.
    release.notify_one();
    sandbox.produce_to(&topic, &[job("after", "acme")]).await;
    while ran.lock().unwrap().len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics = reqwest::get(format!("http://{admin}/metrics")).await.unwrap().text().await.unwrap();
    let counted: Vec<&str> = metrics.lines().filter(|line| line.starts_with("tally_broker_dropped_total{")).collect();
    shutdown.cancel();
    workers.await.unwrap().expect("the workers stop cleanly");
    let mut ran = ran.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, vec!["after", "other", "slow"], "only the jobs not dropped ran");
    assert_eq!(counted, vec!["tally_broker_dropped_total{queue=\"dropping\"} 5"]);
}

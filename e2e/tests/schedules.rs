//! Periodic jobs end to end: a schedule that fires every second, served by three
//! real brokers for two minutes while the broker enqueueing it is killed -9 twice.
//! Every tick runs exactly one job (a rerun of that job aside, never a second
//! one), and `tally jobs schedules` lists the next runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::jobs::api::{DequeuedJob, QueueStats};
use tally_core::jobs::limits::partition_of;
use tally_core::jobs::Tick;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tally_shared::kafka::now_ms;
use tokio_util::sync::CancellationToken;

const QUEUE: &str = r#"
[[queue]]
name = "ticks"
partitions = 4
lease_ms = 2000
unique_for_ms = 600000

[[queue.schedule]]
name = "every-second"
cron = "* * * * * *"
payload = { hello = "world" }

[[queue.schedule]]
name = "nightly"
cron = "0 30 2 * * *"
time_zone = "Europe/Paris"
missed = "skip"
"#;

const BROKERS: [&str; 3] = ["broker-a", "broker-b", "broker-c"];

/// Each tick's runs, by their place in the topic (partition, offset).
type Places = BTreeMap<i64, BTreeSet<(i32, i64)>>;

/// The broker serving the schedule's partition, by its name.
async fn enqueuer(urls: &BTreeMap<&'static str, String>) -> Option<&'static str> {
    let partition = partition_of(&Tick::partition_key("every-second"), 4);
    for url in urls.values() {
        let Ok(response) = reqwest::get(format!("{url}/v1/queues/ticks")).await else { continue };
        let Ok(stats) = response.json::<QueueStats>().await else { continue };
        let owner = stats.partitions.iter().find(|p| p.partition == partition)?.owner.clone()?;
        return urls.iter().find(|(_, url)| url.ends_with(&owner)).map(|(name, _)| *name);
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_runs_one_job_per_tick_through_two_kills_of_its_broker() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUE).await;
    sandbox.config.broker.declarations = Some(declarations.clone());
    let mut urls: BTreeMap<&'static str, String> =
        BROKERS.iter().map(|name| (*name, sandbox.spawn_broker(name, &declarations))).collect();

    let (ok, out) = sandbox.cli(&["jobs", "schedules", "ticks"]);
    assert!(ok && out.contains("ticks every-second \"* * * * * *\" (UTC): next "), "{out}");
    assert!(
        out.contains("ticks nightly \"0 30 2 * * *\" (Europe/Paris): next ") && out.contains("T02:30:00+0"),
        "{out}"
    );

    // Where each tick's job ran: its place in the topic (a rerun has the same).
    let ran: Arc<Mutex<Places>> = Arc::default();
    let handler = {
        let ran = ran.clone();
        move |job: DequeuedJob| {
            let ran = ran.clone();
            async move {
                assert_eq!(job.payload.get(), r#"{"hello":"world"}"#);
                let at: i64 = job.id.strip_prefix("every-second-").unwrap().parse().unwrap();
                ran.lock().unwrap().entry(at).or_default().insert((job.partition, job.offset));
                Outcome::Ack
            }
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: urls.values().cloned().collect(),
        queue: "ticks".into(),
        concurrency: 8,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let workers = tokio::spawn(worker::run(options, handler, shutdown.clone()));
    let started = Instant::now();
    let begun = now_ms();
    for kill in [40, 80] {
        while started.elapsed() < Duration::from_secs(kill) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let victim = enqueuer(&urls).await.expect("a broker serves the schedule");
        sandbox.kill9(victim);
        tokio::time::sleep(Duration::from_secs(2)).await;
        urls.insert(victim, sandbox.spawn_broker(victim, &declarations));
    }
    while started.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ended = now_ms();
    // Late ticks of the last seconds land too.
    tokio::time::sleep(Duration::from_secs(10)).await;
    shutdown.cancel();
    workers.await.unwrap().expect("the workers stop cleanly");

    let ran = ran.lock().unwrap();
    let first = *ran.keys().next().expect("ticks ran");
    assert!(first - begun < 15_000, "the first tick ran {} ms after the start", first - begun);
    let expected: Vec<i64> = (0..).map(|s| first + s * 1_000).take_while(|at| *at <= ended).collect();
    let missing: Vec<&i64> = expected.iter().filter(|at| !ran.contains_key(at)).collect();
    let twice: Vec<(&i64, &BTreeSet<(i32, i64)>)> = ran.iter().filter(|(_, places)| places.len() > 1).collect();
    let logs = BROKERS.iter().map(|name| sandbox.log(name)).collect::<Vec<_>>().join("\n");
    let tail: String =
        logs.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(30).collect::<Vec<_>>().join("\n");
    assert!(
        missing.is_empty() && twice.is_empty(),
        "{} ticks expected; missing {missing:?}; run as two jobs {twice:?}\n{tail}",
        expected.len()
    );
    assert!(expected.len() >= 115, "{} ticks in two minutes", expected.len());
}

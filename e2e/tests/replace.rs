//! Replaced and debounced unique jobs end to end: 2 000 keys enqueued five times
//! on a queue that replaces (each job due in 30 s) and on one that debounces
//! (30 s quiet period), with a broker killed -9 and started again between the
//! rounds. Each key runs its last job only, a debounced one no sooner than its
//! quiet period after the last enqueue; a key whose job ran takes a new one; a
//! job naming a window on such a queue is a dead letter saying why.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::jobs::api::DequeuedJob;
use tally_core::wire::DeadLetter;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tally_shared::kafka::now_ms;
use tokio_util::sync::CancellationToken;

const QUEUES: &str = r#"
[[queue]]
name = "latest"
partitions = 4
lease_ms = 2000
on_duplicate = "replace"

[[queue]]
name = "debounced"
partitions = 4
lease_ms = 2000
on_duplicate = "debounce"
debounce_ms = 30000
"#;

const KEYS: usize = 2_000;
const ROUNDS: usize = 5;
const WAIT_MS: i64 = 30_000;

/// Round `round` of every key; on `latest` each job is due at `run_at`.
fn round(round: usize, run_at: Option<i64>) -> Vec<(Option<String>, Vec<u8>)> {
    (0..KEYS)
        .map(|k| {
            let due = run_at.map_or(String::new(), |at| format!(r#","run_at":{at}"#));
            let job =
                format!(r#"{{"id":"r{k}-{round}","payload":{{"k":{k},"round":{round}}},"unique_key":"key{k}"{due}}}"#);
            (Some(format!("key{k}")), job.into_bytes())
        })
        .collect()
}

/// What ran: by queue and key, the rounds, and when the first of them started.
type Ran = Arc<Mutex<BTreeMap<(&'static str, u64), (BTreeSet<u64>, i64)>>>;

fn worker_of(
    queue: &'static str,
    brokers: &[String],
    ran: &Ran,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<tally_jobs_client::Result<Arc<worker::WorkerCounts>>> {
    let ran = ran.clone();
    let handler = move |job: DequeuedJob| {
        let ran = ran.clone();
        async move {
            let payload: serde_json::Value = serde_json::from_str(job.payload.get()).unwrap();
            let (k, round) = (payload["k"].as_u64().unwrap(), payload["round"].as_u64().unwrap());
            let mut ran = ran.lock().unwrap();
            let (rounds, _) = ran.entry((queue, k)).or_insert_with(|| (BTreeSet::new(), now_ms()));
            rounds.insert(round);
            Outcome::Ack
        }
    };
    let options = WorkerOptions {
        brokers: brokers.to_vec(),
        queue: queue.into(),
        concurrency: 32,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    tokio::spawn(worker::run(options, handler, shutdown.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_runs_its_last_job_through_a_broker_kill() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUES).await;
    let a = sandbox.spawn_broker("broker-a", &declarations);
    let b = sandbox.spawn_broker("broker-b", &declarations);
    let (latest, debounced) = (sandbox.names.jobs("latest"), sandbox.names.jobs("debounced"));

    let ran: Ran = Arc::default();
    let shutdown = CancellationToken::new();
    let brokers = [a, b];
    let workers = [worker_of("latest", &brokers, &ran, &shutdown), worker_of("debounced", &brokers, &ran, &shutdown)];

    let due = now_ms() + WAIT_MS;
    let mut last_enqueue = 0;
    for r in 0..ROUNDS {
        if r == 2 {
            sandbox.kill9("broker-a");
        }
        if r == 3 {
            sandbox.spawn_broker("broker-a", &declarations);
        }
        sandbox.produce_to(&latest, &round(r, Some(due))).await;
        last_enqueue = now_ms();
        sandbox.produce_to(&debounced, &round(r, None)).await;
    }
    // On a queue that replaces or debounces a key is held while its job waits:
    // a window means nothing there.
    let windowed = r#"{"id":"windowed","payload":{},"unique_key":"w","unique_for_ms":1000}"#;
    sandbox.produce_to(&debounced, &[(None, windowed.as_bytes().to_vec())]).await;

    let deadline = Instant::now() + Duration::from_secs(240);
    while ran.lock().unwrap().len() < 2 * KEYS {
        assert!(Instant::now() < deadline, "jobs never ran:\n{}", sandbox.log("broker-b"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A key whose job ran takes a new one, due now.
    sandbox.produce_to(&latest, &round(ROUNDS, None)).await;
    let finished = |ran: &BTreeMap<(&str, u64), (BTreeSet<u64>, i64)>| {
        ran.iter().filter(|((queue, _), (rounds, _))| *queue == "latest" && rounds.len() == 2).count()
    };
    while finished(&ran.lock().unwrap()) < KEYS {
        assert!(Instant::now() < deadline, "the new round never ran:\n{}", sandbox.log("broker-b"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Late runs of replaced jobs would show here.
    tokio::time::sleep(Duration::from_secs(3)).await;
    shutdown.cancel();
    for worker in workers {
        worker.await.unwrap().expect("the workers stop cleanly");
    }

    let ran = ran.lock().unwrap();
    let rounds: BTreeMap<(&str, u64), BTreeSet<u64>> =
        ran.iter().map(|(key, (rounds, _))| (*key, rounds.clone())).collect();
    let last = ROUNDS as u64 - 1;
    let expected: BTreeMap<(&str, u64), BTreeSet<u64>> = (0..KEYS as u64)
        .flat_map(|k| [(("debounced", k), BTreeSet::from([last])), (("latest", k), BTreeSet::from([last, last + 1]))])
        .collect();
    let wrong: Vec<_> = rounds.iter().filter(|(key, got)| expected.get(*key) != Some(got)).take(5).collect();
    assert!(wrong.is_empty(), "keys that ran other rounds than their last: {wrong:?}");
    assert_eq!(rounds, expected);
    let early: Vec<_> = ran
        .iter()
        .filter(|((queue, _), (_, started))| *queue == "debounced" && *started < last_enqueue + WAIT_MS)
        .take(5)
        .collect();
    assert!(early.is_empty(), "debounced jobs that ran before their quiet period ended: {early:?}");

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), 1, Duration::from_secs(30));
    let letters: Vec<DeadLetter> = letters.iter().map(|bytes| serde_json::from_slice(bytes).unwrap()).collect();
    let reasons: Vec<&str> = letters.iter().map(|letter| letter.reason.as_str()).collect();
    assert_eq!(
        reasons,
        ["unique_for_ms: the queue's on_duplicate = \"debounce\" holds a unique key while its job waits, for no \
          window; leave unique_for_ms out"]
    );
}

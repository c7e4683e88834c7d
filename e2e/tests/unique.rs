//! Unique jobs end to end: 100 000 enqueues of 20 000 unique keys (each key
//! enqueued five times, as a producer that retries would), with a broker killed -9
//! and started again in between. Each key runs one job, never two different ones;
//! every other enqueue is a `duplicate` dead letter; the CLI refuses a held key.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::jobs::api::DequeuedJob;
use tally_core::wire::DeadLetter;
use tally_e2e::Sandbox;
use tally_jobs_client::{self as worker, Outcome, WorkerOptions};
use tokio_util::sync::CancellationToken;

const QUEUE: &str = r#"
[[queue]]
name = "uniq"
partitions = 4
lease_ms = 2000
unique_for_ms = 600000
"#;

const KEYS: usize = 20_000;
const ROUNDS: usize = 5;

fn round(round: usize) -> Vec<(Option<String>, Vec<u8>)> {
    (0..KEYS)
        .map(|k| {
            let job = format!(r#"{{"id":"u{k}-{round}","payload":{{"k":{k}}},"unique_key":"key{k}"}}"#);
            (Some(format!("u{k}-{round}")), job.into_bytes())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_unique_key_runs_one_job_through_retries_and_a_broker_kill() {
    let mut sandbox = Sandbox::start().await;
    let declarations = sandbox.declare(QUEUE).await;
    let a = sandbox.spawn_broker("broker-a", &declarations);
    let b = sandbox.spawn_broker("broker-b", &declarations);
    sandbox.config.broker.listen = b.trim_start_matches("http://").to_string();
    let topic = sandbox.names.jobs("uniq");

    // Which jobs ran, by unique key.
    let ran: Arc<Mutex<BTreeMap<u64, BTreeSet<String>>>> = Arc::default();
    let handler = {
        let ran = ran.clone();
        move |job: DequeuedJob| {
            let ran = ran.clone();
            async move {
                let payload: serde_json::Value = serde_json::from_str(job.payload.get()).unwrap();
                ran.lock().unwrap().entry(payload["k"].as_u64().unwrap()).or_default().insert(job.id);
                Outcome::Ack
            }
        }
    };
    let shutdown = CancellationToken::new();
    let options = WorkerOptions {
        brokers: vec![a.clone(), b.clone()],
        queue: "uniq".into(),
        concurrency: 32,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let workers = tokio::spawn(worker::run(options, handler, shutdown.clone()));

    for r in 0..2 {
        sandbox.produce_to(&topic, &round(r)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while ran.lock().unwrap().len() < KEYS / 3 {
        assert!(Instant::now() < deadline, "the run never got going:\n{}", sandbox.log("broker-a"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sandbox.kill9("broker-a");
    sandbox.produce_to(&topic, &round(2)).await;
    sandbox.spawn_broker("broker-a", &declarations);
    for r in 3..ROUNDS {
        sandbox.produce_to(&topic, &round(r)).await;
    }
    while ran.lock().unwrap().len() < KEYS {
        if Instant::now() > deadline {
            let stats = match reqwest::get(format!("{b}/v1/queues/uniq")).await {
                Ok(answer) => answer.text().await.unwrap_or_default(),
                Err(err) => err.to_string(),
            };
            panic!(
                "{} of {KEYS} keys ran; the queue: {stats}\nbroker-a:\n{}\nbroker-b:\n{}",
                ran.lock().unwrap().len(),
                sandbox.log("broker-a"),
                sandbox.log("broker-b")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A held key is refused by the CLI, before anything is written; a new one is not.
    let (ok, out) = sandbox.cli(&["jobs", "enqueue", "uniq", "{}", "--unique-key", "key7"]);
    assert!(!ok && out.contains("refused: unique_key \"key7\" is held until"), "{out}");
    let (ok, out) = sandbox.cli(&["jobs", "enqueue", "uniq", r#"{"k":20000}"#, "--unique-key", "fresh", "--id", "cli"]);
    assert!(ok, "{out}");

    let letters = sandbox.read_topic(&sandbox.names.dead_letter(), KEYS * (ROUNDS - 1), Duration::from_secs(300));
    while ran.lock().unwrap().len() < KEYS + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    workers.await.unwrap().expect("the workers stop cleanly");

    let ran = ran.lock().unwrap();
    let twice: Vec<(&u64, &BTreeSet<String>)> = ran.iter().filter(|(_, ids)| ids.len() != 1).take(5).collect();
    assert!(twice.is_empty(), "keys that ran other than one job: {twice:?}");
    assert_eq!(ran.len(), KEYS + 1, "every key ran");
    let reasons: BTreeMap<bool, usize> = letters.iter().fold(BTreeMap::new(), |mut counts, bytes| {
        let letter: DeadLetter = serde_json::from_slice(bytes).unwrap();
        *counts.entry(letter.reason.starts_with("duplicate: unique_key \"key")).or_default() += 1;
        counts
    });
    assert_eq!(reasons, BTreeMap::from([(true, KEYS * (ROUNDS - 1))]), "every other enqueue is a duplicate letter");
}

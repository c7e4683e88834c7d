//! Rollups that never go backwards. Two counters (`tally up --counters 2`) share
//! the shards while increments flow; one is paused (SIGSTOP) mid-rollup for longer
//! than its lease, the other takes its shards over and publishes, then the paused
//! one resumes. The example consumer (`examples/rollups-consumer`) reads the
//! rollups topic from the beginning and its newest value of every live bucket
//! equals the model; the buckets of a 1 s resolution kept 8 s all end as
//! tombstones. Then the first record of every bucket is delivered again, as a
//! counter that lost its shards delivers what it had queued: the consumer's
//! answer does not change (by log order alone it would); a record it cannot read
//! stops it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tally_core::model::Model;
use tally_core::time::bucket_start;
use tally_core::wire::{Increment, ROLLUP_POSITION_HEADER};
use tally_e2e::workload::Record;
use tally_e2e::{check, signal, Sandbox};
use tally_shared::config::ResolutionConfig;

const ENTITIES: usize = 12;
/// (name, width) of the resolutions configured here, and the all-time bucket.
const RESOLUTIONS: [(&str, i64); 2] = [("1s", 1_000), ("1m", 60_000)];
/// How long the 1 s buckets are kept.
const SHORT_RETENTION_MS: i64 = 8_000;

/// The children of `parent` named `tally-counter`, by pid.
fn counters(parent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some((head, rest)) = stat.rsplit_once(") ") else { continue };
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == parent && head.ends_with("(tally-counter") {
            found.push(pid);
        }
    }
    found
}

/// What was produced: the model of every bucket (`entity/views/resolution/bucket`
/// → sum) and the all-time model.
#[derive(Default)]
struct Produced {
    buckets: BTreeMap<String, i128>,
    model: Model,
    last_ts: i64,
}

impl Produced {
    /// A record of increments stamped now, added to the model.
    fn record(&mut self, rng: &mut StdRng, index: usize) -> Record {
        let ts = tally_shared::kafka::now_ms();
        let mut elements = Vec::new();
        for _ in 0..20 {
            let entity = format!("r:{}", rng.random_range(0..ENTITIES));
            let delta = rng.random_range(1..10i64);
            for (name, width) in RESOLUTIONS {
                *self.buckets.entry(format!("{entity}/views/{name}/{}", bucket_start(ts, width))).or_default() +=
                    i128::from(delta);
            }
            *self.buckets.entry(format!("{entity}/views/all/0")).or_default() += i128::from(delta);
            self.model.apply(Increment { entity: entity.clone(), metric: "views".into(), delta, ts, id: None });
            elements.push(json!({"entity": entity, "metric": "views", "delta": delta, "ts": ts}));
        }
        self.last_ts = ts;
        Record {
            graph: false,
            key: format!("k{index}"),
            payload: json!(elements).to_string().into_bytes(),
            timestamp: ts,
        }
    }
}

/// The example consumer, run over the whole topic until it is idle for 4 s.
fn run_consumer(sandbox: &Sandbox) -> std::process::Output {
    let topic = sandbox.names.rollups();
    let args = ["--bootstrap", &sandbox.kafka.bootstrap_servers, "--topic", &topic, "--exit-when-idle-ms", "4000"];
    sandbox.run("tally-rollups-consumer", &args)
}

/// The example consumer's view of the topic: it prints each change it keeps; the
/// last line of every key is its newest (`None`: a tombstone).
fn consume(sandbox: &Sandbox) -> BTreeMap<String, Option<i128>> {
    let output = run_consumer(sandbox);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let mut latest = BTreeMap::new();
    for line in String::from_utf8(output.stdout).unwrap().lines() {
        let change: Value = serde_json::from_str(line).unwrap();
        let key = change["key"].as_str().unwrap().to_string();
        let value = match change["op"].as_str() {
            Some("upsert") => {
                let rollup = &change["rollup"];
                assert_eq!(rollup["total"], rollup["direct"], "{line}: no graph here");
                Some(i128::from(rollup["total"].as_i64().unwrap()))
            }
            Some("delete") => None,
            _ => panic!("{line}"),
        };
        latest.insert(key, value);
    }
    latest
}

/// The consumer's newest value of every live bucket equals the model (no 1 s
/// bucket is live any more), and on the topic itself — before any expiry of the
/// consumer's own — every 1 s bucket published, and only those, ends as a
/// tombstone.
fn check_rollups(sandbox: &Sandbox, consumed: &BTreeMap<String, Option<i128>>, produced: &Produced) {
    let short = |key: &str| key.contains("/views/1s/");
    let live: BTreeMap<String, i128> =
        consumed.iter().filter_map(|(key, value)| Some((key.clone(), (*value)?))).collect();
    let want: BTreeMap<String, i128> =
        produced.buckets.iter().filter(|(key, _)| !short(key)).map(|(k, v)| (k.clone(), *v)).collect();
    assert_eq!(live, want, "the newest value of every live bucket");
    let on_topic = sandbox.latest_rollups(Duration::from_secs(5));
    let expired: BTreeSet<&str> = on_topic.expired().collect();
    let published_short: BTreeSet<&str> = consumed.keys().map(String::as_str).filter(|key| short(key)).collect();
    assert_eq!(expired, published_short, "every 1 s bucket, and only those, ends as a tombstone");
    assert!(published_short.len() > 10, "only {} 1 s buckets published", published_short.len());
    assert!(published_short.iter().all(|key| produced.buckets.contains_key(*key)), "produced buckets only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_paused_mid_rollup_past_its_lease_never_sets_a_bucket_back() {
    let mut sandbox = Sandbox::start().await;
    // The user's own file: the sandbox's Kafka and ports, and buckets that expire soon.
    let config = sandbox.path("tally.toml");
    let mut own = sandbox.config.clone();
    let resolution = |width: &str, retention: String| ResolutionConfig { width: width.into(), retention };
    own.counting.resolutions =
        vec![resolution("1s", format!("{}s", SHORT_RETENTION_MS / 1_000)), resolution("1m", "6h".into())];
    tally_shared::harness::write_config(&own, std::path::Path::new(&config)).unwrap();
    let up = sandbox.spawn_up(2, &[("TALLY_CONFIG", config)]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while counters(up).len() < 2 {
        assert!(Instant::now() < deadline, "two counters never ran:\n{}", sandbox.log("tally-up"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Increments flow, a record every 50 ms, until told to stop.
    let produced = Arc::new(Mutex::new(Produced::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let sandbox = Arc::new(sandbox);
    let producing = {
        let (produced, stop, sandbox) = (produced.clone(), stop.clone(), sandbox.clone());
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(51);
            let mut index = 0;
            while !stop.load(Ordering::SeqCst) {
                let record = produced.lock().unwrap().record(&mut rng, index);
                sandbox.produce(&[record]).await;
                index += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            index
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    // One counter stops mid-rollup (rollups go every second) for more than twice its
    // lease; the other takes its shards over and publishes newer values.
    let paused = counters(up)[0];
    signal(paused, libc::SIGSTOP);
    tokio::time::sleep(Duration::from_secs(12)).await;
    stop.store(true, Ordering::SeqCst);
    let records = producing.await.unwrap();
    let (model, entities) = {
        let produced = produced.lock().unwrap();
        (produced.model.clone(), (0..ENTITIES).map(|i| format!("r:{i}")).collect::<Vec<_>>())
    };
    let metrics = vec!["views".to_string()];
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(60)).await;
    signal(paused, libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sandbox.log("tally-up").contains("lease lapsed") {
        assert!(Instant::now() < deadline, "the paused counter never noticed its lease lapsed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(60)).await;
    // Every 1 s bucket expired, and its tombstone had a round to go out.
    let last_ts = produced.lock().unwrap().last_ts;
    let expired_at = bucket_start(last_ts, 1_000) + 1_000 + SHORT_RETENTION_MS;
    let wait = (expired_at - tally_shared::kafka::now_ms()).max(0) as u64 + 3_000;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let produced = Arc::try_unwrap(produced).ok().expect("the producer ended").into_inner().unwrap();
    eprintln!("{records} records produced, {} buckets", produced.buckets.len());
    check_rollups(&sandbox, &consume(&sandbox), &produced);

    // Late deliveries: the first record of every bucket, again, after the rest.
    let topic = sandbox.names.rollups();
    let mut first: BTreeMap<Vec<u8>, tally_e2e::ReadRecord> = BTreeMap::new();
    for record in sandbox.read_records(&topic, Duration::from_secs(5), |_| false) {
        let key = record.key.clone().expect("rollups are keyed");
        first.entry(key).or_insert(record);
    }
    let changed = first.values().filter(|record| !record.tombstone).count();
    assert!(changed > 10, "{changed} buckets to deliver late");
    sandbox.produce_with_header(&topic, ROLLUP_POSITION_HEADER, first.into_values()).await;
    check_rollups(&sandbox, &consume(&sandbox), &produced);

    // A record it cannot read (a stray producer's) stops the consumer, naming it:
    // it might have held a bucket's newest value.
    sandbox.produce_to(&topic, &[(Some("r:0/views/all/0".into()), b"{not a rollup".to_vec())]).await;
    let output = run_consumer(&sandbox);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the consumer went on past garbage");
    assert!(stderr.starts_with("Error: the record at partition ") && stderr.contains("rollup: "), "{stderr}");
}

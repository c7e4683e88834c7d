//! Standbys take over at once: three counters run as their own processes with one
//! standby per shard (`counter.standby_replicas = 1`). While increments, graph
//! updates and probes flow, the counter owning the most shards is killed with -9
//! and stays dead (a lost node): every shard it owned answers a read holding a
//! write made after the kill within 10 s (2 s is the bench's goal; CI is busy),
//! taken over by the counter that held it as a standby (`tally bench failover`
//! compares with no standbys).
//! It comes back, then the next owner dies the same way. The totals end equal to the model,
//! and the probes never read back in time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use tally_core::position::token::{TokenTopic, WriteToken};
use tally_core::sharding::shard_of;
use tally_core::wire::{CounterStatus, Increment, ShardState};
use tally_e2e::probes::{probes, watch_probes};
use tally_e2e::workload::{Record, Workload};
use tally_e2e::{check, encode, Sandbox};
use tally_shared::local_broker::free_port;

const SHARDS: u32 = 8;
const COUNTERS: [&str; 3] = ["counter-0", "counter-1", "counter-2"];
/// How soon a dead owner's shards must answer fresh reads again here.
const FRESH_AGAIN_WITHIN: Duration = Duration::from_secs(10);

/// Starts the counter `name` (again) with its own data, ports and one standby per
/// shard; its read address.
fn spawn_counter(sandbox: &mut Sandbox, name: &'static str, read_addr: &str) {
    let (data_dir, read_addr) = (sandbox.path(name), read_addr.to_string());
    sandbox.spawn_instance(name, "tally-counter", move |config| {
        config.counter.static_assignment = false;
        config.counter.instance = name.to_string();
        config.counter.data_dir = data_dir.into();
        config.counter.read_listen = read_addr;
        config.counter.admin_listen = "127.0.0.1:0".into();
        config.counter.standby_replicas = 1;
        config.counter.heartbeat_ms = 500;
        config.counter.member_timeout_ms = 3_000;
        config.snapshots.interval_ms = 2_000;
    });
}

/// Which counter (by read address) serves each shard, once all are served.
async fn owners(sandbox: &Sandbox, within: Duration) -> BTreeMap<u32, String> {
    let deadline = Instant::now() + within;
    loop {
        let (_, status) = sandbox.get("/v1/status").await;
        let shards = status["shards"].as_array().cloned().unwrap_or_default();
        let serving: BTreeMap<u32, String> = (shards.iter())
            .filter(|s| s["state"] == "serving")
            .filter_map(|s| Some((s["shard"].as_u64()? as u32, s["counter"].as_str()?.to_string())))
            .collect();
        if serving.len() == SHARDS as usize {
            return serving;
        }
        assert!(Instant::now() < deadline, "not every shard served within {within:?}: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A probe's direct all-time count read through tally-query with `params`, and
/// who served it.
async fn direct(sandbox: &Sandbox, probe: &str, params: &str) -> Result<(i64, String), String> {
    let (status, body) = sandbox.get(&format!("/v1/counters/{}/hits?kind=direct{params}", encode(probe))).await;
    match (status, body["value"].as_i64(), body["as_of"][0]["served_by"].as_str()) {
        (200, Some(value), Some(by)) => Ok((value, by.to_string())),
        _ => Err(format!("{probe}: {status} {body}")),
    }
}

/// Reads `probe` allowing 5 s of staleness every 20 ms until its owner answers
/// again: how many answers a standby gave. Each holds at most what was produced,
/// and at least `before` (read of the owner before the kill) but the last round of
/// probes, which the standby may not have applied yet.
async fn stale_reads(sandbox: &Sandbox, probe: &str, before: i64, produced: &Mutex<i64>) -> Result<usize, String> {
    let (mut by_standby, started) = (0, Instant::now());
    // What each answer said, for a failure's message.
    let mut said: Vec<String> = Vec::new();
    while started.elapsed() < FRESH_AGAIN_WITHIN {
        let answer = direct(sandbox, probe, "&max_staleness_ms=5000").await;
        let outcome = match &answer {
            Ok((_, by)) => by.clone(),
            Err(err) => err.chars().take(160).collect(),
        };
        if said.last().is_none_or(|last| !last.ends_with(&outcome)) {
            said.push(format!("{:?}: {outcome}", started.elapsed()));
        }
        if let Ok((value, by)) = answer {
            let ceiling = *produced.lock().unwrap();
            if value < before - 1 || value > ceiling {
                return Err(format!(
                    "{probe} read {value} from the {by}: {before} before the kill, {ceiling} produced"
                ));
            }
            match by.as_str() {
                "standby" => by_standby += 1,
                _ if by_standby == 0 => return Err(format!("no answer from a standby before the owner's: {said:?}")),
                _ => return Ok(by_standby),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match by_standby {
        0 => Err(format!("no answer from a standby: {said:?}")),
        _ => Ok(by_standby),
    }
}

/// What the counters logged of ownership, for a failure's message.
fn takeovers(sandbox: &Sandbox) -> String {
    let said = ["ownership changed", "shards assigned", "announcing", "lease", "restored"];
    let mut lines: Vec<String> = (COUNTERS.iter())
        .flat_map(|name| sandbox.log(name).lines().map(|line| format!("{line} ({name})")).collect::<Vec<_>>())
        .filter(|line| said.iter().any(|s| line.contains(s)))
        .collect();
    lines.sort();
    lines.join("\n")
}

/// Which counters (by read address) hold each shard as a standby, asked of every
/// counter that serves some (`/internal/v1/status`): usually one, two while a
/// counter taking a shard holds it as a standby meanwhile.
async fn standbys(owners: &BTreeMap<u32, String>) -> BTreeMap<u32, Vec<String>> {
    let mut held: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let counters: std::collections::BTreeSet<&String> = owners.values().collect();
    for addr in counters {
        let status: CounterStatus = reqwest::get(format!("http://{addr}/internal/v1/status"))
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|err| panic!("{addr}'s status: {err}"))
            .json()
            .await
            .unwrap();
        for shard in status.shards.iter().filter(|s| s.state == ShardState::Standby) {
            held.entry(shard.shard).or_default().push(addr.clone());
        }
    }
    held
}

/// Writes one increment of `entity` and reads it back through tally-query with the
/// write's token until an answer holds it; how long after `since` that was.
async fn fresh_again(
    sandbox: &Sandbox,
    producer: &FutureProducer,
    entity: &str,
    written: &Mutex<i64>,
    since: Instant,
) -> Result<Duration, String> {
    let client = reqwest::Client::new();
    let topic = sandbox.names.increments();
    let payload = json!({"entity": entity, "metric": "hits"}).to_string();
    let delivery = producer.send(FutureRecord::to(&topic).key(entity).payload(&payload), Duration::from_secs(10));
    let delivery = delivery.await.map_err(|(err, _)| format!("producing: {err}"))?;
    let expected = {
        let mut written = written.lock().unwrap();
        *written += 1;
        *written
    };
    let token =
        WriteToken { topic: TokenTopic::Increments, partition: delivery.partition as u32, offset: delivery.offset };
    let url = format!(
        "{}/v1/counters/{}/hits?kind=direct&after={}&max_wait_ms=100",
        sandbox.query_url,
        encode(entity),
        token.encode()
    );
    loop {
        let answer = client.get(&url).timeout(Duration::from_secs(5)).send().await;
        if let Some(response) = answer.ok().filter(|response| response.status() == 200) {
            let body: Value = response.json().await.unwrap_or_default();
            if body["value"].as_i64() != Some(expected) {
                return Err(format!("{entity}: read {body} with a token, {expected} written"));
            }
            return Ok(since.elapsed());
        }
        if since.elapsed() > FRESH_AGAIN_WITHIN * 3 {
            return Err(format!("{entity}: no fresh read {:?} after the kill", since.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_owners_shards_are_served_by_their_standbys_within_seconds() {
    let mut sandbox = Sandbox::start().await;
    let reads: BTreeMap<&str, String> =
        COUNTERS.iter().map(|name| (*name, format!("127.0.0.1:{}", free_port().unwrap()))).collect();
    for name in COUNTERS {
        spawn_counter(&mut sandbox, name, &reads[name]);
    }
    sandbox.spawn_ready(&["tally-ingester", "tally-graph", "tally-query"]).await;
    owners(&sandbox, Duration::from_secs(90)).await;

    let workload = Workload::generate_mixed(52, 800, tally_shared::kafka::now_ms(), 0.2);
    let mut model = workload.model.clone();
    let probes = probes(SHARDS);
    let produced = Arc::new(Mutex::new(0i64));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_probes(sandbox.query_url.clone(), probes.clone(), produced.clone(), stop.clone()));
    // One entity per shard written and read back with tokens after each kill.
    let fresh: BTreeMap<u32, String> = (0..)
        .map(|k| format!("fresh:{k}"))
        .map(|entity| (shard_of(&entity, SHARDS), entity))
        .scan(BTreeMap::new(), |seen, (shard, entity)| {
            seen.entry(shard).or_insert(entity);
            Some(seen.clone())
        })
        .find(|seen| seen.len() == SHARDS as usize)
        .unwrap();
    let written: BTreeMap<u32, Mutex<i64>> = fresh.keys().map(|&shard| (shard, Mutex::new(0))).collect();
    let producer: FutureProducer = tally_shared::kafka::producer_config(&sandbox.kafka).unwrap().create().unwrap();

    let chunks: Vec<Vec<Record>> =
        workload.records.chunks(workload.records.len().div_ceil(8)).map(<[Record]>::to_vec).collect();
    let mut chunks = chunks.into_iter();
    let mut send = async |sandbox: &Sandbox, model: &mut tally_core::model::Model| -> bool {
        let chunk = chunks.next();
        let mut records = chunk.clone().unwrap_or_default();
        let now = tally_shared::kafka::now_ms();
        let elements: Vec<_> = probes.iter().map(|p| json!({"entity": p, "metric": "hits"})).collect();
        records.push(Record {
            graph: false,
            key: format!("probe-{now}"),
            payload: json!(elements).to_string().into_bytes(),
            timestamp: now,
        });
        *produced.lock().unwrap() += 1;
        for p in &probes {
            model.apply(Increment { entity: p.clone(), metric: "hits".into(), delta: 1, ts: now, id: None });
        }
        sandbox.produce(&records).await;
        chunk.is_some()
    };

    let mut figures = Vec::new();
    let mut victims = Vec::new();
    for round in 0..2 {
        send(&sandbox, &mut model).await;
        // Every counter owning shards, every shard served and with one standby, owners
        // and standbys the same on two looks a settle apart (standbys are placed anew
        // a second after a move; a counter starting or coming back joins late).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut before = (BTreeMap::new(), BTreeMap::new());
        let owners = loop {
            let owners = owners(&sandbox, Duration::from_secs(60)).await;
            let now = (owners.clone(), standbys(&owners).await);
            let owning: std::collections::BTreeSet<&String> = owners.values().collect();
            let placed = owning.len() == COUNTERS.len()
                && now.1.len() == SHARDS as usize
                && now.1.values().all(|held| held.len() == 1);
            if placed && now == before {
                break owners;
            }
            assert!(Instant::now() < deadline, "owners and standbys never settled: {now:?}");
            before = now;
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        };
        // The counter owning the most shards dies and stays dead.
        let (victim, addr) = (COUNTERS.iter())
            .map(|name| (*name, reads[name].clone()))
            .max_by_key(|(_, addr)| owners.values().filter(|owner| *owner == addr).count())
            .unwrap();
        let lost: Vec<u32> = owners.iter().filter(|(_, owner)| **owner == addr).map(|(shard, _)| *shard).collect();
        let standbys = standbys(&owners).await;
        send(&sandbox, &mut model).await;
        let probe = probes.iter().find(|probe| shard_of(probe, SHARDS) == lost[0]).expect("a probe per shard");
        let before = direct(&sandbox, probe, "").await.expect("the probe read").0;
        sandbox.kill9(victim);
        let killed = Instant::now();
        victims.push(victim);
        let sending = send(&sandbox, &mut model);
        let probing = futures::future::join_all(
            lost.iter().map(|shard| fresh_again(&sandbox, &producer, &fresh[shard], &written[shard], killed)),
        );
        let stale = stale_reads(&sandbox, probe, before, &produced);
        let (_, times, stale) = tokio::join!(sending, probing, stale);
        let times: Vec<Duration> = times.into_iter().collect::<Result<_, _>>().unwrap_or_else(|err| panic!("{err}"));
        let slowest = times.iter().max().copied().unwrap_or_default();
        figures.push(format!("round {round}: {victim} owned {lost:?}; fresh again after {times:?}"));
        assert!(
            slowest <= FRESH_AGAIN_WITHIN,
            "{victim}'s shards {lost:?} were fresh again only after {times:?}:\n{}",
            takeovers(&sandbox)
        );
        // Meanwhile reads allowing 5 s of staleness were answered by the standby.
        let stale = stale.unwrap_or_else(|err| {
            panic!("{err}\n{victim} at {addr}; owners {owners:?}; standbys {standbys:?}\n{}", takeovers(&sandbox))
        });
        figures.push(format!("  reads allowing staleness answered by the standby {stale} times meanwhile"));
        // Each was taken by the counter that held it as a standby.
        let after = crate::owners(&sandbox, Duration::from_secs(60)).await;
        let not_standbys: Vec<String> = (lost.iter())
            .filter(|shard| !after.get(shard).is_some_and(|took| standbys.get(shard).is_some_and(|h| h.contains(took))))
            .map(|shard| format!("{shard}: {:?} after, standbys {:?}", after.get(shard), standbys.get(shard)))
            .collect();
        assert!(
            not_standbys.is_empty(),
            "taken by other than their standbys (shard, new owner, standbys): {not_standbys:?}"
        );
        send(&sandbox, &mut model).await;
        // The node comes back (its shards, or others, move to it again).
        spawn_counter(&mut sandbox, victim, &reads[victim]);
    }
    while send(&sandbox, &mut model).await {}
    let now = tally_shared::kafka::now_ms();
    for (shard, entity) in &fresh {
        let count = *written[shard].lock().unwrap();
        for _ in 0..count {
            model.apply(Increment { entity: entity.clone(), metric: "hits".into(), delta: 1, ts: now, id: None });
        }
    }

    let mut entities = workload.entities.clone();
    entities.extend(probes.iter().cloned());
    entities.extend(fresh.values().cloned());
    let mut metrics = workload.metrics.clone();
    metrics.push("hits".into());
    let settled = Instant::now() + Duration::from_secs(180);
    while let Err(mismatches) = check::all_time(&sandbox, &model, &entities, &metrics).await {
        assert!(Instant::now() < settled, "counts never matched the model:\n{mismatches}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let (violations, answered) = watcher.await.unwrap();
    assert!(violations.is_empty(), "reads went back in time:\n{}", violations.join("\n"));
    assert!(answered > 20, "only {answered} probe reads answered");
    eprintln!("{}", figures.join("\n"));
}

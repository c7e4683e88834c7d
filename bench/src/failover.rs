//! `tally-bench failover`: how long a killed counter's shards go unanswered. Several
//! counters share the shards (`--counters`, 3) under a steady load; the counter
//! owning the most shards is killed with -9 and stays dead, like a lost node. Right
//! after the kill, one increment is written to an entity of each shard it owned and
//! read back through tally-query with the write's token until the answer holds it:
//! that shard is fresh again. A kill's figure is its slowest shard's; the counter
//! then comes back and the next kill waits until every shard is served, the
//! counters own within one shard of one another (the one started again took its
//! share) and every shard has a standby again. One case per `--standbys` value (1
//! and 0: with a standby per shard, which only catches up, and without, where the
//! new owner restores a snapshot, if any, and replays the log after it), each on
//! topics of its own.
//!
//! The floor is `--member-timeout-ms`: nothing can tell a dead counter from a slow
//! one sooner. Rollups are off: on the local broker their records would be most of
//! the writes, and a broker slow to acknowledge heartbeats lapses leases.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use tally_core::position::token::{TokenTopic, WriteToken};
use tally_core::sharding::shard_of;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{producer_config, TopicNames};
use tally_shared::local_broker::free_port;

use crate::pipeline::{Entities, Latencies, Pace, Rig};

#[derive(Debug, Clone, clap::Args)]
pub struct FailoverBenchArgs {
    /// Counter processes sharing the shards.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=8))]
    pub counters: u32,
    /// Standbys per shard, one case each (all cases in one run).
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 0])]
    pub standbys: Vec<u32>,
    /// Kills per case.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub kills: u64,
    /// The steady load, in increments/s.
    #[arg(long, default_value_t = 20_000)]
    pub rate: u64,
    /// Increments per message of the load.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub per_message: u32,
    /// `counter.member_timeout_ms`: how long a silent counter is taken for alive.
    #[arg(long, default_value_t = 1_500)]
    pub member_timeout_ms: u64,
    /// `counter.heartbeat_ms`.
    #[arg(long, default_value_t = 300)]
    pub heartbeat_ms: u64,
}

/// The counters' names: `--counters` of them.
const NAMES: [&str; 8] =
    ["counter-0", "counter-1", "counter-2", "counter-3", "counter-4", "counter-5", "counter-6", "counter-7"];
/// How long a killed counter's shards may stay unanswered before the case fails.
const GIVE_UP: Duration = Duration::from_secs(120);

pub async fn run(config: TallyConfig, args: FailoverBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.heartbeat_ms > 0 && args.heartbeat_ms * 3 <= args.member_timeout_ms,
        "--member-timeout-ms must be at least 3 × --heartbeat-ms"
    );
    let mut rig = Rig::start(config).await?;
    if rig.config.auth.reader_token.is_some() {
        rig.finish().await?;
        bail!("tally-bench failover sends no token: run it with auth.reader_token unset");
    }
    println!(
        "failover bench: {} counters sharing the shards under {} increments/s ({} per message); the one owning the most killed with -9, {} times per case, until each shard it owned answers a read holding a write made after the kill; member timeout {} ms, heartbeats every {} ms; snapshots every {} records or {} ms; broker {}",
        args.counters,
        args.rate,
        args.per_message,
        args.kills,
        args.member_timeout_ms,
        args.heartbeat_ms,
        rig.config.snapshots.every_records,
        rig.config.snapshots.interval_ms,
        rig.config.kafka.bootstrap_servers,
    );
    let mut lines = Vec::new();
    for (run, &standbys) in args.standbys.iter().enumerate() {
        // Each case on an empty local broker: it slows as its database grows.
        rig.fresh_local_broker(run).await?;
        let names = rig.fresh_topics().await?;
        let measured = case(&mut rig, &names, standbys, &args).await;
        rig.stop_all().await?;
        let (all, first) = match measured {
            Ok(measured) => measured,
            Err(err) => {
                rig.finish().await?;
                return Err(err);
            }
        };
        let case = match standbys {
            0 => "no standbys".to_string(),
            1 => "1 standby per shard".to_string(),
            n => format!("{n} standbys per shard"),
        };
        lines.push(format!(
            "{case:<22} every shard of the killed counter fresh again: p50 {:>7.0} ms  p99 {:>7.0} ms  max {:>7.0} ms; its first shard: p50 {:>7.0} ms  ({} kills)",
            all.at(0.5),
            all.at(0.99),
            all.at(1.0),
            first.at(0.5),
            all.0.len(),
        ));
    }
    rig.finish().await?;
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// One case: the counters with `standbys` per shard, the ingester, tally-query and
/// the load; `--kills` kills. Returns how long each kill's slowest and fastest shard
/// took to answer fresh reads again.
async fn case(
    rig: &mut Rig,
    names: &TopicNames,
    standbys: u32,
    args: &FailoverBenchArgs,
) -> anyhow::Result<(Latencies, Latencies)> {
    let counters: Vec<(&'static str, u16, u16)> = NAMES[..args.counters as usize]
        .iter()
        .map(|name| Ok((*name, free_port()?, free_port()?)))
        .collect::<anyhow::Result<_>>()?;
    for &counter in &counters {
        start_counter(rig, counter, standbys, args).await?;
    }
    let ports = rig.ports;
    rig.run("tally-ingester", ports.ingester_admin).await?;
    rig.run("tally-query", ports.query_admin).await?;
    let client = reqwest::Client::new();
    let query = format!("http://127.0.0.1:{}", ports.query);
    let shards = served(&client, &query, Duration::from_secs(120)).await?.len() as u32;
    let producer: FutureProducer = producer_config(&rig.config.kafka)?.create()?;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(steady_load(
        producer.clone(),
        names.increments(),
        args.rate,
        args.per_message as usize,
        stop.clone(),
    ));
    let probes = probe_entities(shards);
    let mut written: BTreeMap<u32, i64> = BTreeMap::new();
    let (mut all, mut first) = (Vec::new(), Vec::new());
    let progress = crate::pipeline::bar(args.kills, &format!("kills, {standbys} standbys"));
    let outcome: anyhow::Result<()> = async {
        for _ in 0..args.kills {
            // Every shard served, by counters that own within one shard of one
            // another (the one started again took its share: a kill while it joins
            // would lose a shard it is still taking), and with a standby again, on
            // two looks a settle apart (standbys are placed anew a second after a move).
            let deadline = Instant::now() + GIVE_UP;
            let mut looks = 0;
            let owners = loop {
                let owners = served(&client, &query, GIVE_UP).await?;
                let placed = match standbys {
                    0 => shards as usize,
                    _ => standbys_placed(&client, counters.iter().map(|(_, read, _)| *read)).await,
                };
                let owned: Vec<(&str, usize)> =
                    counters.iter().map(|(name, read, _)| (*name, owned_by(&owners, *read))).collect();
                let settled = placed >= shards as usize && evenly_owned(owned.iter().map(|(_, count)| *count));
                looks = if settled { looks + 1 } else { 0 };
                if looks == 2 {
                    break owners;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "not settled within {GIVE_UP:?}: shards owned {owned:?} (each within one of the others \
                     wanted), {placed} of {shards} shards with a standby"
                );
                tokio::time::sleep(Duration::from_millis(1_500)).await;
            };
            let (victim, read_port, _) =
                *counters.iter().max_by_key(|(_, read, _)| owned_by(&owners, *read)).context("no counters")?;
            let lost: Vec<u32> = owners.iter().filter(|(_, addr)| is_at(addr, read_port)).map(|(s, _)| *s).collect();
            rig.kill(victim).await?;
            let killed = Instant::now();
            let reads = lost.iter().map(|shard| {
                let count = written.entry(*shard).or_default();
                *count += 1;
                fresh_again(&client, &query, &producer, names, &probes[shard], *count, killed)
            });
            let mut times: Vec<Duration> =
                futures::future::join_all(reads).await.into_iter().collect::<anyhow::Result<_>>()?;
            times.sort();
            first.extend(times.first().copied());
            all.extend(times.last().copied());
            progress.suspend(|| {
                println!("  {standbys} standbys: {victim} killed, owning {lost:?}: fresh again after {times:?}")
            });
            let counter = counters.iter().find(|(name, _, _)| *name == victim).copied().context("the victim")?;
            start_counter(rig, counter, standbys, args).await?;
            progress.inc(1);
        }
        Ok(())
    }
    .await;
    progress.finish_and_clear();
    stop.store(true, Ordering::SeqCst);
    let sent = load.await??;
    outcome?;
    anyhow::ensure!(sent > 0, "the load sent nothing");
    all.sort();
    first.sort();
    Ok((Latencies(all), Latencies(first)))
}

/// Starts a counter (again) with its own name, data, ports and `standbys`.
async fn start_counter(
    rig: &mut Rig,
    (name, read_port, admin_port): (&'static str, u16, u16),
    standbys: u32,
    args: &FailoverBenchArgs,
) -> anyhow::Result<()> {
    let data_dir = rig.data_dir().join(name);
    rig.run_counter(name, admin_port, |config| {
        config.counter.static_assignment = false;
        config.counter.instance = name.to_string();
        config.counter.data_dir = data_dir;
        config.counter.read_listen = format!("127.0.0.1:{read_port}");
        config.counter.admin_listen = format!("127.0.0.1:{admin_port}");
        config.counter.standby_replicas = standbys;
        config.counter.heartbeat_ms = args.heartbeat_ms;
        config.counter.member_timeout_ms = args.member_timeout_ms;
        // A rollup record per changed bucket and second is most of what the local
        // broker writes under a load; failover does not depend on it.
        config.counter.rollups = false;
    })
    .await
}

/// Waits until tally-query's status says every shard is served; which counter
/// (read address) serves each.
async fn served(client: &reqwest::Client, query: &str, within: Duration) -> anyhow::Result<BTreeMap<u32, String>> {
    let deadline = Instant::now() + within;
    loop {
        let status: Value = client.get(format!("{query}/v1/status")).send().await?.json().await?;
        let shards = status["shards"].as_array().cloned().unwrap_or_default();
        let serving: BTreeMap<u32, String> = (shards.iter())
            .filter(|s| s["state"] == "serving")
            .filter_map(|s| Some((u32::try_from(s["shard"].as_u64()?).ok()?, s["counter"].as_str()?.to_string())))
            .collect();
        if !shards.is_empty() && serving.len() == shards.len() {
            return Ok(serving);
        }
        anyhow::ensure!(Instant::now() < deadline, "not every shard served within {within:?}: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether counters owning `owned` shards each own within one shard of one another;
/// false for no counters.
fn evenly_owned(owned: impl Iterator<Item = usize>) -> bool {
    let owned: Vec<usize> = owned.collect();
    owned.iter().max().zip(owned.iter().min()).is_some_and(|(most, least)| most - least <= 1)
}

/// How many shards the counter reading on `port` owns, by `owners`.
fn owned_by(owners: &BTreeMap<u32, String>, port: u16) -> usize {
    owners.values().filter(|addr| is_at(addr, port)).count()
}

/// Whether the read address `addr` is on `port`.
fn is_at(addr: &str, port: u16) -> bool {
    addr.rsplit_once(':').is_some_and(|(_, at)| at == port.to_string())
}

/// How many shards the counters reading on `ports` hold as standbys (a counter
/// that does not answer counts none).
async fn standbys_placed(client: &reqwest::Client, ports: impl Iterator<Item = u16>) -> usize {
    let mut held = std::collections::BTreeSet::new();
    for port in ports {
        let status = client.get(format!("http://127.0.0.1:{port}/internal/v1/status")).send().await;
        let Ok(status) = status else { continue };
        let Ok(status) = status.json::<tally_core::wire::CounterStatus>().await else { continue };
        let standby = status.shards.iter().filter(|s| s.state == tally_core::wire::ShardState::Standby);
        held.extend(standby.map(|s| s.shard));
    }
    held.len()
}

/// An entity on each shard, written and read back after each kill.
fn probe_entities(shards: u32) -> BTreeMap<u32, String> {
    let mut probes = BTreeMap::new();
    for k in 0.. {
        let entity = format!("failover:{k}");
        probes.entry(shard_of(&entity, shards)).or_insert(entity);
        if probes.len() == shards as usize {
            break;
        }
    }
    probes
}

/// Writes one increment of `entity` (its `count`th) and reads it back through
/// tally-query with the write's token until an answer holds it: how long after
/// `since`.
async fn fresh_again(
    client: &reqwest::Client,
    query: &str,
    producer: &FutureProducer,
    names: &TopicNames,
    entity: &str,
    count: i64,
    since: Instant,
) -> anyhow::Result<Duration> {
    let topic = names.increments();
    let payload = format!(r#"{{"entity":"{entity}","metric":"views"}}"#);
    let delivered =
        producer.send(FutureRecord::to(&topic).key(entity).payload(&payload), Duration::from_secs(30)).await;
    let delivered = delivered.map_err(|(err, _)| anyhow::anyhow!("producing a probe: {err}"))?;
    let token =
        WriteToken { topic: TokenTopic::Increments, partition: delivered.partition as u32, offset: delivered.offset };
    let url = format!("{query}/v1/counters/{entity}/views?kind=direct&after={}&max_wait_ms=100", token.encode());
    loop {
        let response = client.get(&url).timeout(Duration::from_secs(5)).send().await;
        if let Some(response) = response.ok().filter(|response| response.status() == 200) {
            let body: Value = response.json().await?;
            anyhow::ensure!(body["value"].as_i64() == Some(count), "{entity}: read {body} holding its {count}th write");
            return Ok(since.elapsed());
        }
        anyhow::ensure!(since.elapsed() < GIVE_UP, "{entity} answered no fresh read {GIVE_UP:?} after the kill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends messages of `per_message` Zipf-skewed increments at `rate` until `stop`;
/// how many increments were acknowledged.
async fn steady_load(
    producer: FutureProducer,
    topic: String,
    rate: u64,
    per_message: usize,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<u64> {
    let mut draw = Entities::new(100_000, 52);
    let mut pace = Pace::new(rate, per_message);
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent = 0u64;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        for _ in 0..pace.due() {
            let (key, payload) = draw.message(per_message);
            let record = FutureRecord::to(&topic).key(&key).payload(&payload);
            pending
                .push(producer.send_result(record).map_err(|(err, _)| anyhow::anyhow!("producing the load: {err}"))?);
        }
        while let Some(Some(delivered)) = futures::FutureExt::now_or_never(pending.next()) {
            delivered
                .map_err(|_| anyhow::anyhow!("the producer dropped a record"))?
                .map_err(|(err, _)| anyhow::anyhow!("{err}"))?;
            sent += per_message as u64;
        }
    }
    while let Some(delivered) = pending.next().await {
        delivered
            .map_err(|_| anyhow::anyhow!("the producer dropped a record"))?
            .map_err(|(err, _)| anyhow::anyhow!("{err}"))?;
        sent += per_message as u64;
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_evenly_owned_when_no_counter_owns_two_more_than_another() {
        let owners = |counts: &[(u16, u32)]| -> BTreeMap<u32, String> {
            let mut shard = 0;
            let mut owners = BTreeMap::new();
            for &(port, count) in counts {
                for _ in 0..count {
                    owners.insert(shard, format!("127.0.0.1:{port}"));
                    shard += 1;
                }
            }
            owners
        };
        let ports = [1u16, 11, 111];
        let even = |counts: &[(u16, u32)]| {
            let owners = owners(counts);
            evenly_owned(ports.into_iter().map(|port| owned_by(&owners, port)))
        };
        assert!(even(&[(1, 3), (11, 3), (111, 2)]));
        assert!(even(&[(1, 3), (11, 3), (111, 3)]));
        assert!(!even(&[(1, 4), (11, 2), (111, 2)]));
        // A counter started again that owns nothing yet.
        assert!(!even(&[(1, 4), (11, 4)]));
        assert!(!evenly_owned(std::iter::empty()));
        let spread = owners(&[(1, 4), (11, 3), (111, 1)]);
        assert_eq!(ports.map(|port| owned_by(&spread, port)), [4, 3, 1]);
    }
}

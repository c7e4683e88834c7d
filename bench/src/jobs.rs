//! `tally-bench jobs`: a dequeue broker against the raw consume rate of its queue
//! topic, in the same run on the same broker.
//!
//! 1. `jobs` jobs are produced to a one-partition queue.
//! 2. Baseline: a plain consumer reads the topic from the start (records/s).
//! 3. A `tally-broker` runs in this process; once its buffer holds every job,
//!    single dequeues and acks go one after the other (latency of a dequeue served from the
//!    buffer, and of the whole dequeue → ack round trip).
//! 4. The worker library drains the rest with `concurrency` jobs at once (jobs/s).
//! 5. Pickup: how soon a job produced now is handed out — on the drained queue (the
//!    baseline), and at the top level of a queue with two priority levels behind a
//!    `backlog` of low jobs its broker holds (a buffer that size: priorities order
//!    what a broker holds).
//! 6. Limits: `keyed` jobs on `keys` concurrency keys drained by the same workers
//!    from a queue with a per-key limit of 1 and from the same queue unlimited
//!    (the baseline), each once its broker holds them all.
//!
//! Uses the configured Kafka, or starts a local one when none is configured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tally_jobs_client::{self as worker, BrokerClient, Outcome, WorkerOptions};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{producer_config, TopicNames};
use tally_shared::local_broker::free_port;
use tally_shared::topics::{self, Declarations};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, clap::Args)]
pub struct JobsBenchArgs {
    #[arg(long, default_value_t = 50_000)]
    pub jobs: usize,
    /// Sequential dequeue → ack round trips measured for latency.
    #[arg(long, default_value_t = 2_000)]
    pub round_trips: usize,
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Low jobs ahead of each high one in the pickup phase.
    #[arg(long, default_value_t = 100_000)]
    pub backlog: usize,
    /// Jobs produced one at a time and timed until handed out, per queue.
    #[arg(long, default_value_t = 200)]
    pub pickups: usize,
    /// Jobs of the limits phase, per queue.
    #[arg(long, default_value_t = 50_000)]
    pub keyed: usize,
    /// Concurrency keys of the limits phase.
    #[arg(long, default_value_t = 10_000)]
    pub keys: usize,
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

pub async fn run(mut config: TallyConfig, args: JobsBenchArgs) -> anyhow::Result<()> {
    let scratch = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
    let local = crate::pipeline::local_broker_unless_configured(&mut config, scratch.path()).await?;
    config.kafka.topic_prefix = format!("bench{:08x}.", rand::random::<u32>());
    let names = TopicNames::new(&config.kafka.topic_prefix);
    let queue = "bench";
    let declarations = format!(
        "{}\n[[queue]]\nname = \"{queue}\"\npartitions = 1\nbuffer = {}\nlease_ms = 60000\n\
         [[queue]]\nname = \"{RANKED}\"\npartitions = 1\nbuffer = {}\nlease_ms = 60000\npriority_levels = 2\n\
         [[queue]]\nname = \"{UNLIMITED}\"\npartitions = 1\nbuffer = {}\nlease_ms = 1000\nmax_lease_ms = 1000\n\
         [[queue]]\nname = \"{LIMITED}\"\npartitions = 1\nbuffer = {}\nlease_ms = 1000\nmax_lease_ms = 1000\n\
         [queue.limits]\nper_key = 1\n",
        topics::BUILTIN,
        args.jobs,
        args.backlog + args.pickups,
        args.keyed,
        args.keyed,
    );
    let declarations_path = scratch.path().join("topics.toml");
    std::fs::write(&declarations_path, &declarations)?;
    topics::apply(&config.kafka, &Declarations::parse(&declarations)?).await?;
    let topic = names.jobs(queue);
    println!(
        "jobs bench: {} jobs on one partition, {} sequential round trips, then concurrency {}; broker {}",
        args.jobs, args.round_trips, args.concurrency, config.kafka.bootstrap_servers
    );

    let producer: FutureProducer = producer_config(&config.kafka)?.create()?;
    produce_all(&producer, &topic, (0..args.jobs).map(|i| format!(r#"{{"id":"b{i}","payload":{{"n":{i}}}}}"#))).await?;

    // Baseline: the raw consume rate of the same topic.
    let kafka = config.kafka.clone();
    let (raw_topic, total) = (topic.clone(), args.jobs);
    let raw_per_sec = tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
        let mut consumer_config = tally_shared::kafka::consumer_config(&kafka)?;
        consumer_config.set("group.id", "tally-bench-raw").set("enable.auto.commit", "false");
        let consumer: BaseConsumer = consumer_config.create()?;
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(&raw_topic, 0, Offset::Beginning)?;
        consumer.assign(&assignment)?;
        let started = Instant::now();
        let mut seen = 0;
        while seen < total && started.elapsed() < Duration::from_secs(300) {
            if let Some(Ok(_)) = consumer.poll(Duration::from_millis(100)) {
                seen += 1;
            }
        }
        Ok(seen as f64 / started.elapsed().as_secs_f64())
    })
    .await??;

    // The broker, in this process.
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    config.broker.listen = format!("127.0.0.1:{port}");
    config.broker.admin_listen = format!("127.0.0.1:{}", free_port()?);
    config.broker.declarations = Some(declarations_path);
    config.broker.heartbeat_ms = 200;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(tally_broker::run(config.clone(), shutdown.clone()));
    let client = BrokerClient::new(queue, None)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let stats = client.stats(&base).await.ok();
        let ready = stats.as_ref().map_or(0, |s| s.partitions.iter().map(|p| p.ready).sum::<usize>());
        // Measure once everything is fetched: dequeues served from the buffer, not
        // competing with the fetch.
        if ready >= args.jobs {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the broker never filled its buffer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut dequeues = Vec::with_capacity(args.round_trips);
    let mut trips = Vec::with_capacity(args.round_trips);
    for _ in 0..args.round_trips.min(args.jobs) {
        let started = Instant::now();
        let jobs = client.dequeue(&base, 1, None, 0).await?;
        dequeues.push(started.elapsed());
        let job = jobs.first().context("the buffer ran dry")?;
        client.ack(&base, &job.lease).await?;
        trips.push(started.elapsed());
    }
    dequeues.sort();
    trips.sort();

    let remaining = args.jobs - args.round_trips.min(args.jobs);
    let through_broker = drain(&base, queue, args.concurrency, remaining).await?;

    // Pickups: on the drained queue, then at the top level behind the backlog.
    let empty = pickups(&producer, &client, &base, &topic, None, args.pickups).await?;
    produce_all(
        &producer,
        &names.jobs(RANKED),
        (0..args.backlog).map(|i| format!(r#"{{"id":"low{i}","payload":{{}}}}"#)),
    )
    .await?;
    let ranked = BrokerClient::new(RANKED, None)?;
    wait_until_held(&ranked, &base, args.backlog).await?;
    let behind = pickups(&producer, &ranked, &base, &names.jobs(RANKED), Some(1), args.pickups).await?;

    // Limits: the same keyed load, limited and not.
    let keys = args.keys.max(1);
    let keyed = |i: usize| format!(r#"{{"id":"k{i}","payload":{{}},"concurrency_key":"key{}"}}"#, i % keys);
    let mut keyed_rates = Vec::new();
    for name in [UNLIMITED, LIMITED] {
        produce_all(&producer, &names.jobs(name), (0..args.keyed).map(keyed)).await?;
        let client = BrokerClient::new(name, None)?;
        wait_until_held(&client, &base, args.keyed).await?;
        keyed_rates.push(drain(&base, name, args.concurrency, args.keyed).await?);
    }
    shutdown.cancel();
    if let Err(err) = running.await {
        eprintln!("jobs bench: the broker ended badly: {err}");
    }
    if let Some(mut broker) = local {
        tokio::task::spawn_blocking(move || broker.stop()).await?;
    }

    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    println!("raw consume of the topic       : {raw_per_sec:>10.0} records/s");
    println!(
        "dequeue served from the buffer : p50 {:>7.0} µs   p99 {:>7.0} µs",
        micros(percentile(&dequeues, 0.50)),
        micros(percentile(&dequeues, 0.99))
    );
    println!(
        "dequeue → ack round trip       : p50 {:>7.0} µs   p99 {:>7.0} µs",
        micros(percentile(&trips, 0.50)),
        micros(percentile(&trips, 0.99))
    );
    println!(
        "through the broker, {} workers : {through_broker:>10.0} jobs/s  ({:.2}x the raw consume rate)",
        args.concurrency,
        through_broker / raw_per_sec.max(1e-9)
    );
    let millis = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "pickup on a drained queue      : p50 {:>7.1} ms   p99 {:>7.1} ms",
        millis(percentile(&empty, 0.50)),
        millis(percentile(&empty, 0.99))
    );
    println!(
        "pickup, high behind {:>6} low: p50 {:>7.1} ms   p99 {:>7.1} ms  ({:.2}x the drained queue's p99)",
        args.backlog,
        millis(percentile(&behind, 0.50)),
        millis(percentile(&behind, 0.99)),
        percentile(&behind, 0.99).as_secs_f64() / percentile(&empty, 0.99).as_secs_f64().max(1e-9)
    );
    println!("{} jobs on {keys} keys, {} workers:", args.keyed, args.concurrency);
    println!("  unlimited                    : {:>10.0} jobs/s", keyed_rates[0]);
    println!(
        "  at most 1 in flight per key  : {:>10.0} jobs/s  ({:.2}x unlimited)",
        keyed_rates[1],
        keyed_rates[1] / keyed_rates[0].max(1e-9)
    );
    Ok(())
}

/// Queues of the limits phase: the same load with a per-key limit and without.
const UNLIMITED: &str = "keyed";
const LIMITED: &str = "keyed-limited";

/// Drains `count` jobs of `queue` with the worker library at `concurrency` (each
/// acked at once): jobs per second.
async fn drain(base: &str, queue: &str, concurrency: usize, count: usize) -> anyhow::Result<f64> {
    let acked = Arc::new(AtomicU64::new(0));
    let counter = acked.clone();
    let handler = move |_job| {
        counter.fetch_add(1, Ordering::Relaxed);
        async { Outcome::Ack }
    };
    let options = WorkerOptions {
        brokers: vec![base.to_string()],
        queue: queue.into(),
        concurrency,
        lease_ms: None,
        auth_token: None,
        stop_grace_ms: 1_000,
        spans: None,
    };
    let stop_workers = CancellationToken::new();
    let started = Instant::now();
    let workers = tokio::spawn(worker::run(options, handler, stop_workers.clone()));
    while (acked.load(Ordering::Relaxed) as usize) < count && started.elapsed() < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = acked.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    stop_workers.cancel();
    if let Err(err) = workers.await {
        eprintln!("jobs bench: the workers ended badly: {err}");
    }
    Ok(rate)
}

/// The queue with priority levels of the pickup phase.
const RANKED: &str = "ranked";

/// Produces every payload to `topic` and waits for every acknowledgement.
async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    payloads: impl Iterator<Item = String>,
) -> anyhow::Result<()> {
    let sends = payloads.map(|payload| {
        let producer = producer.clone();
        let topic = topic.to_string();
        async move {
            producer
                .send(FutureRecord::to(&topic).key("k").payload(&payload), Duration::from_secs(60))
                .await
                .map(|_| ())
        }
    });
    for result in futures::future::join_all(sends).await {
        result.map_err(|(err, _)| anyhow::anyhow!("producing: {err}"))?;
    }
    Ok(())
}

/// Waits until the broker holds at least `jobs` ready jobs of `client`'s queue,
/// and no partition of it is held after its take-over.
async fn wait_until_held(client: &BrokerClient, base: &str, jobs: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let stats = client.stats(base).await.ok();
        let partitions = stats.as_ref().map(|s| s.partitions.as_slice()).unwrap_or_default();
        let free = partitions.iter().all(|p| p.held_until.is_none());
        if free && partitions.iter().map(|p| p.ready).sum::<usize>() >= jobs {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the broker never held {jobs} jobs");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Produces `count` jobs one at a time (at `level`), each timed from its
/// acknowledgement until a dequeue hands it out (lower jobs handed out meanwhile,
/// before the broker fetched it, are acked), then acked; the times, sorted.
async fn pickups(
    producer: &FutureProducer,
    client: &BrokerClient,
    base: &str,
    topic: &str,
    level: Option<u8>,
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(count);
    for i in 0..count {
        let id = format!("pickup{i}");
        let mut job = serde_json::json!({"id": id, "payload": {}});
        if let Some(level) = level {
            job["priority"] = level.into();
        }
        produce_all(producer, topic, std::iter::once(job.to_string())).await?;
        let started = Instant::now();
        // Until the broker has fetched it, lower jobs it holds go out (acked here).
        loop {
            let jobs = client.dequeue(base, 1, None, 1_000).await?;
            let Some(job) = jobs.into_iter().next() else {
                anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "{id} was never handed out");
                continue;
            };
            client.ack(base, &job.lease).await?;
            if job.id == id {
                break;
            }
            anyhow::ensure!(level.is_some(), "{} was handed out on a drained queue before {id}", job.id);
        }
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times)
}

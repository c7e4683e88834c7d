//! `tally-bench ingest` and `tally-bench read`: the real services, each its own
//! process as `tally up` runs them, on the configured Kafka (or a local broker),
//! against a baseline measured in the same run.
//!
//! - **ingest**: a backlog of increments (one or many per message) is produced first;
//!   the baseline is a plain consumer reading those same records; then a counter and
//!   an ingester start on the backlog and the time from the ingester's first record to
//!   the counter having applied every increment gives increments/s end to end, with
//!   each process's CPU per million increments, the bytes per increment on the
//!   input and the shard topic, and the counter's write batches (how big, keys
//!   written per increment). Then the raw rate again, and the counter alone
//!   rebuilding every shard from the shard topic (its stores deleted).
//! - **read**: p50/p99/p999 of single reads and of batches of 100 through tally-query,
//!   from closed-loop clients on keep-alive connections; idle, then while the ingester
//!   and the counter catch up with a fresh backlog at full speed. Each phase also
//!   prints its share of slow reads inside tally-query and the cores each process
//!   kept busy ([`crate::read_phase`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::counter_apply::Zipf;
use crate::shapes::Shape;
use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tally_shared::config::TallyConfig;
use tally_shared::harness;
use tally_shared::kafka::{producer_config, TopicNames};
use tally_shared::local_broker::{free_port, LocalBroker};
use tally_shared::topics::{self, Declarations};
use tokio::process::{Child, Command};

use crate::cpu::CpuWatch;
use crate::read_phase::PhaseWatch;

#[derive(Debug, Clone, clap::Args)]
pub struct IngestBenchArgs {
    /// Cases as INCREMENTS_PER_MESSAGExMESSAGES, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = ["1x200000".to_string(), "100x50000".to_string()])]
    pub cases: Vec<String>,
    #[arg(long, default_value_t = 100_000)]
    pub entities: usize,
    /// Runs every case this many times (the cases taking turns, each run on a fresh
    /// local broker) and ends with each case's median ratio: on a broker that shares
    /// the machine, one run's raw rate can be a tenth off the next one's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// The backlogs' shapes, comma-separated, each run on every case; with more than
    /// one, the run ends with each shape's cost per increment against zipf's.
    #[arg(long, value_delimiter = ',', default_values_t = [Shape::Zipf])]
    pub shapes: Vec<Shape>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ReadBenchArgs {
    /// Seconds each phase (single reads, batches; idle, ingesting) runs.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Concurrent clients, each on its own keep-alive connection.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Requests per second each phase offers, spread evenly over the clients (open
    /// loop, as wrk2 measures: each request's latency counts from when it was due,
    /// so a client that falls behind counts its waiting). Unset: closed loop, each
    /// client sends its next request when the last one is answered (the most the
    /// machine serves).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: Option<u32>,
    /// The batch phases' rate, in batches of 100 per second (default: a tenth of
    /// `--rate`, the same lookups per second).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_rate: Option<u32>,
    /// Entities written (and read) with a Zipf skew.
    #[arg(long, default_value_t = 10_000)]
    pub entities: usize,
    /// Increments per second offered steadily while the "ingesting" phases run
    /// (default: half the capacity the warm-up measures). A phase that applies less
    /// than 90 % of it prints no "while ingesting" figure.
    #[arg(long)]
    pub ingest_rate: Option<u64>,
    /// Increments per message of that load (and of the warm-up): 1 (the broker's
    /// per-record work dominates) or more (tally's applying does).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub ingest_per_message: u32,
    /// Messages of the warm-up backlog, whose apply rate is the capacity.
    #[arg(long, default_value_t = 20_000)]
    pub warm_messages: usize,
    /// Publish rollups, as a default deployment does. Off unless asked: a rollup
    /// record per changed bucket and second is most of what the local broker writes
    /// under a load, and saturates it well below the offered rate (reads do not
    /// depend on rollups).
    #[arg(long)]
    pub rollups: bool,
}

/// The batch phases' open-loop rate, if any.
fn batch_rate(args: &ReadBenchArgs) -> Option<u32> {
    args.batch_rate.or(args.rate.map(|rate| (rate / 10).max(1)))
}

/// Paces a load of `rate` increments/s in messages of `per_message`: how many
/// messages are due at each look.
pub(crate) struct Pace {
    per_second: f64,
    owed: f64,
    last: Instant,
}

impl Pace {
    pub(crate) fn new(rate: u64, per_message: usize) -> Self {
        Self { per_second: rate as f64 / per_message.max(1) as f64, owed: 0.0, last: Instant::now() }
    }

    /// The messages due since the last look.
    pub(crate) fn due(&mut self) -> u64 {
        self.due_at(Instant::now())
    }

    fn due_at(&mut self, now: Instant) -> u64 {
        self.owed += self.per_second * (now - self.last).as_secs_f64();
        self.last = now;
        let due = self.owed.floor();
        self.owed -= due;
        due as u64
    }
}

/// A steady offered load: `rate` increments/s on the increments topic, in messages
/// of `per_message`, produced on a task of its own until [`SteadyLoad::stop`].
struct SteadyLoad {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<u64>>,
    /// Increments the broker acknowledged so far.
    delivered: Arc<AtomicU64>,
}

impl SteadyLoad {
    fn start(
        config: &TallyConfig,
        topic: String,
        rate: u64,
        per_message: usize,
        entities: usize,
    ) -> anyhow::Result<Self> {
        // Batches for 50 ms, as a producer sending a steady high rate does.
        let producer: FutureProducer = producer_config(&config.kafka)?.set("linger.ms", "50").create()?;
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let delivered = Arc::new(AtomicU64::new(0));
        let acknowledged = delivered.clone();
        let task = tokio::spawn(async move {
            use futures::{FutureExt, StreamExt};
            let mut draw = Entities::new(entities, 9);
            let mut pending: futures::stream::FuturesUnordered<rdkafka::producer::DeliveryFuture> =
                futures::stream::FuturesUnordered::new();
            let (mut pace, mut sent) = (Pace::new(rate, per_message), 0u64);
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !stopped.is_cancelled() {
                tick.tick().await;
                for _ in 0..pace.due() {
                    let (key, payload) = draw.message(per_message);
                    let mut record = FutureRecord::to(&topic).key(&key).payload(&payload);
                    // A full producer queue: wait for a delivery, then send again.
                    let delivery = loop {
                        match producer.send_result(record) {
                            Ok(delivery) => break delivery,
                            Err((
                                rdkafka::error::KafkaError::MessageProduction(
                                    rdkafka::types::RDKafkaErrorCode::QueueFull,
                                ),
                                back,
                            )) => {
                                record = back;
                                if let Some(delivered) = pending.next().await {
                                    delivered?.map_err(|(err, _)| anyhow::anyhow!("producing the load: {err}"))?;
                                    acknowledged.fetch_add(per_message as u64, Ordering::Relaxed);
                                }
                            }
                            Err((err, _)) => anyhow::bail!("producing the load: {err}"),
                        }
                    };
                    pending.push(delivery);
                    sent += per_message as u64;
                }
                while let Some(Some(delivered)) = pending.next().now_or_never() {
                    delivered?.map_err(|(err, _)| anyhow::anyhow!("producing the load: {err}"))?;
                    acknowledged.fetch_add(per_message as u64, Ordering::Relaxed);
                }
            }
            while let Some(delivered) = pending.next().await {
                delivered?.map_err(|(err, _)| anyhow::anyhow!("producing the load: {err}"))?;
                acknowledged.fetch_add(per_message as u64, Ordering::Relaxed);
            }
            Ok(sent)
        });
        Ok(Self { stop, task, delivered })
    }

    /// Increments the broker acknowledged so far.
    fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// Stops producing; the increments sent.
    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.cancel();
        self.task.await?
    }
}

/// One backlog: `messages` records of `per_message` increments each.
#[derive(Debug, Clone, Copy)]
struct Case {
    per_message: usize,
    messages: usize,
}

impl Case {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let (per, messages) = text.split_once('x').with_context(|| format!("case `{text}`: want PERxMESSAGES"))?;
        let case = Self { per_message: per.trim().parse()?, messages: messages.trim().parse()? };
        anyhow::ensure!(case.per_message > 0 && case.messages > 0, "case `{text}`: both must be above 0");
        Ok(case)
    }

    fn increments(&self) -> u64 {
        (self.per_message * self.messages) as u64
    }

    /// "increment" or "increments", for the count per message.
    fn increment_word(&self) -> &'static str {
        if self.per_message == 1 {
            "increment"
        } else {
            "increments"
        }
    }
}

/// Entities drawn with a Zipf(1.1) skew, as producers' traffic is (and for
/// [`Shape::Hot`], half of the draws the first entity).
pub(crate) struct Entities {
    zipf: Zipf,
    rng: StdRng,
    shape: Shape,
}

impl Entities {
    pub(crate) fn new(count: usize, seed: u64) -> Self {
        Self::shaped(count, seed, Shape::Zipf)
    }

    pub(crate) fn shaped(count: usize, seed: u64, shape: Shape) -> Self {
        Self { zipf: Zipf::new(count, 1.1), rng: StdRng::seed_from_u64(seed), shape }
    }

    fn next(&mut self) -> usize {
        if self.shape == Shape::Hot && rand::Rng::random_bool(&mut self.rng, 0.5) {
            return 0;
        }
        self.zipf.sample(&mut self.rng)
    }

    /// An input message of `per_message` increments of drawn entities (an object
    /// for one, an array for more), keyed by its first entity.
    pub(crate) fn message(&mut self, per_message: usize) -> (String, String) {
        let first = self.next();
        let payload = if per_message == 1 {
            format!(r#"{{"entity":"user:{first}","metric":"views"}}"#)
        } else {
            let items: Vec<String> = std::iter::once(first)
                .chain((1..per_message).map(|_| self.next()))
                .map(|e| format!(r#"{{"entity":"user:{e}","metric":"views"}}"#))
                .collect();
            format!("[{}]", items.join(","))
        };
        (format!("user:{first}"), payload)
    }
}

pub(crate) fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>28} [{bar:30}] {human_pos}/{human_len} ({per_sec}, {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// A local broker with its data under `scratch` when `config` names no Kafka, `config`
/// pointed at it.
pub(crate) async fn local_broker_unless_configured(
    config: &mut TallyConfig,
    scratch: &Path,
) -> anyhow::Result<Option<LocalBroker>> {
    Ok(harness::local_broker_unless_configured(config, scratch.join("kafka"), None).await?)
}

/// Stops the local broker in `local`, if any, deletes its data, and starts an empty
/// one with its data in `dir` in its place, `config` pointed at it.
async fn replace_local_broker(
    local: &mut Option<LocalBroker>,
    config: &mut TallyConfig,
    dir: PathBuf,
) -> anyhow::Result<()> {
    let Some(mut used) = local.take() else { return Ok(()) };
    let used_dir = used.data_dir().to_path_buf();
    tokio::task::spawn_blocking(move || used.stop()).await?;
    std::fs::remove_dir_all(&used_dir).with_context(|| format!("removing {}", used_dir.display()))?;
    config.kafka.bootstrap_servers.clear();
    *local = harness::local_broker_unless_configured(config, dir, None).await?;
    Ok(())
}

/// A broker, a topic prefix of its own, and the services as child processes.
pub(crate) struct Rig {
    pub(crate) config: TallyConfig,
    scratch: tempfile::TempDir,
    local: Option<LocalBroker>,
    pub(crate) ports: Ports,
    children: Vec<(&'static str, Child)>,
    /// For the services' admin endpoints.
    client: reqwest::Client,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Ports {
    counter_read: u16,
    pub(crate) counter_admin: u16,
    pub(crate) ingester_admin: u16,
    pub(crate) query: u16,
    pub(crate) query_admin: u16,
}

impl Rig {
    pub(crate) async fn start(mut config: TallyConfig) -> anyhow::Result<Self> {
        for name in ["tally-ingester", "tally-counter", "tally-query"] {
            let binary = harness::sibling_binary(name)?;
            anyhow::ensure!(
                binary.exists(),
                "{} does not exist: build every binary first (cargo build --release --bins)",
                binary.display()
            );
        }
        let scratch = tempfile::Builder::new().prefix("tally-bench").tempdir_in(".")?;
        let local = local_broker_unless_configured(&mut config, scratch.path()).await?;
        let ports = Ports {
            counter_read: free_port()?,
            counter_admin: free_port()?,
            ingester_admin: free_port()?,
            query: free_port()?,
            query_admin: free_port()?,
        };
        let client = reqwest::Client::new();
        Ok(Self { config, scratch, local, ports, children: Vec::new(), client })
    }

    /// A fresh topic prefix (fresh topics) for the next case, with its topics applied.
    pub(crate) async fn fresh_topics(&mut self) -> anyhow::Result<TopicNames> {
        self.config.kafka.topic_prefix = format!("bench{:08x}.", rand::random::<u32>());
        let declarations = Declarations::load(self.config.broker.declarations.as_deref())?;
        topics::apply(&self.config.kafka, &declarations).await.context("applying topics")?;
        Ok(TopicNames::new(&self.config.kafka.topic_prefix))
    }

    /// An empty local broker in place of the one the runs before used, so that a
    /// run measures alike however many ran before it (the local broker slows as its
    /// database grows); nothing when Kafka is the configured one. `run` names its
    /// data directory.
    pub(crate) async fn fresh_local_broker(&mut self, run: usize) -> anyhow::Result<()> {
        let dir = self.scratch.path().join(format!("kafka-{run}"));
        replace_local_broker(&mut self.local, &mut self.config, dir).await
    }

    /// The current case's data directory (the counter's stores, its snapshots).
    pub(crate) fn data_dir(&self) -> PathBuf {
        self.scratch.path().join(&self.config.kafka.topic_prefix)
    }

    /// The services' config: the rig's, with the current case's data, its own ports,
    /// static assignment (the local broker never evicts a killed member) and quiet logs.
    fn service_config(&self) -> TallyConfig {
        let data = self.data_dir();
        let p = self.ports;
        let local = |port: u16| format!("127.0.0.1:{port}");
        let mut config = self.config.clone();
        config.counter.data_dir = data.join("counter");
        config.snapshots.dir = data.join("snapshots");
        config.counter.static_assignment = true;
        config.ingester.static_assignment = true;
        config.counter.read_listen = local(p.counter_read);
        config.counter.admin_listen = local(p.counter_admin);
        config.ingester.admin_listen = local(p.ingester_admin);
        config.query.listen = local(p.query);
        config.query.admin_listen = local(p.query_admin);
        config.log.level = "warn".into();
        config
    }

    /// Starts a service and waits until its `/readyz` answers 200.
    pub(crate) async fn run(&mut self, name: &'static str, admin_port: u16) -> anyhow::Result<()> {
        self.spawn(name)?;
        self.ready(name, admin_port).await
    }

    fn spawn(&mut self, name: &'static str) -> anyhow::Result<()> {
        self.spawn_with(name, |_| {})
    }

    /// [`Rig::run`] of another instance of a counter, named `name`, its config
    /// changed by `change`.
    pub(crate) async fn run_counter(
        &mut self,
        name: &'static str,
        admin_port: u16,
        change: impl FnOnce(&mut TallyConfig),
    ) -> anyhow::Result<()> {
        self.spawn_as(name, "tally-counter", change)?;
        self.ready(name, admin_port).await
    }

    /// `kill -9` of a started service (it stays dead).
    pub(crate) async fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        while let Some(at) = self.children.iter().position(|(n, _)| *n == name) {
            let (_, mut child) = self.children.remove(at);
            child.kill().await.with_context(|| format!("killing {name}"))?;
        }
        Ok(())
    }

    /// [`Rig::spawn`] with the service's config changed by `change`.
    fn spawn_with(&mut self, name: &'static str, change: impl FnOnce(&mut TallyConfig)) -> anyhow::Result<()> {
        self.spawn_as(name, name, change)
    }

    /// [`Rig::spawn_with`] of `binary` as the instance `name`.
    fn spawn_as(
        &mut self,
        name: &'static str,
        binary: &str,
        change: impl FnOnce(&mut TallyConfig),
    ) -> anyhow::Result<()> {
        let mut config = self.service_config();
        change(&mut config);
        let service = harness::Service { name: name.to_string(), ..harness::Service::sibling(binary, config)? };
        let child = Command::from(service.command(self.scratch.path())?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.children.push((name, child));
        Ok(())
    }

    /// An error if the service `name` started exited.
    fn still_running(&mut self, name: &str) -> anyhow::Result<()> {
        if let Some((_, child)) = self.children.iter_mut().find(|(n, _)| *n == name) {
            if let Some(status) = child.try_wait()? {
                bail!("{name} exited ({status})");
            }
        }
        Ok(())
    }

    /// Waits until a started service's `/readyz` answers 200.
    async fn ready(&mut self, name: &'static str, admin_port: u16) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{admin_port}/readyz");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if self.client.get(&url).send().await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            self.still_running(name)?;
            anyhow::ensure!(Instant::now() < deadline, "{name} was not ready within 120 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops a service as `tally up` does (SIGTERM, SIGKILL after 20 s).
    async fn stop(&mut self, name: &str) -> anyhow::Result<()> {
        while let Some(at) = self.children.iter().position(|(n, _)| *n == name) {
            let (_, mut child) = self.children.remove(at);
            harness::stop(name, &mut child, harness::STOP_GRACE).await;
        }
        Ok(())
    }

    /// Stops the ingester and tally-query, then the counters (any name).
    pub(crate) async fn stop_all(&mut self) -> anyhow::Result<()> {
        for name in ["tally-ingester", "tally-query", "tally-counter"] {
            self.stop(name).await?;
        }
        while let Some((name, _)) = self.children.first() {
            let name = *name;
            self.stop(name).await?;
        }
        Ok(())
    }

    pub(crate) async fn finish(mut self) -> anyhow::Result<()> {
        self.stop_all().await?;
        if let Some(mut broker) = self.local.take() {
            tokio::task::spawn_blocking(move || broker.stop()).await?;
        }
        Ok(())
    }
}

impl Rig {
    /// The running services' and the local broker's process ids, by name.
    fn pids(&self) -> Vec<(&'static str, u32)> {
        let services = self.children.iter().filter_map(|(name, child)| Some((*name, child.id()?)));
        services.chain(self.broker_process()).collect()
    }

    /// The local broker, named, with its process id (none when Kafka is remote).
    fn broker_process(&self) -> Option<(&'static str, u32)> {
        self.local.as_ref().map(|broker| ("broker", broker.pid()))
    }

    /// One value of a Prometheus counter from a service's `/metrics` (summed over
    /// labels).
    pub(crate) async fn scrape(&self, admin_port: u16, metric: &str) -> anyhow::Result<f64> {
        self.scrape_lines(admin_port, metric, |_| true).await
    }

    /// The write batches the counter at `admin_port` applied since it started.
    pub(crate) async fn batches(&self, admin_port: u16) -> anyhow::Result<Batches> {
        Ok(Batches {
            count: self.scrape(admin_port, "tally_counter_batch_keys_count").await?,
            keys: self.scrape(admin_port, "tally_counter_batch_keys_sum").await?,
            seconds: self.scrape(admin_port, "tally_counter_apply_seconds_sum").await?,
            helped: self.scrape(admin_port, "tally_counter_helped_batches_total").await?,
        })
    }

    /// [`Rig::scrape`] of the series whose labels include the value `label`.
    async fn scrape_labelled(&self, admin_port: u16, metric: &str, label: &str) -> anyhow::Result<f64> {
        let quoted = format!("=\"{label}\"");
        self.scrape_lines(admin_port, metric, |labels| labels.contains(&quoted)).await
    }

    async fn scrape_lines(&self, admin_port: u16, metric: &str, labels: impl Fn(&str) -> bool) -> anyhow::Result<f64> {
        Ok(sum_series(&self.metrics_text(admin_port).await?, metric, labels))
    }

    /// A service's whole `/metrics` exposition.
    async fn metrics_text(&self, admin_port: u16) -> anyhow::Result<String> {
        let url = format!("http://127.0.0.1:{admin_port}/metrics");
        Ok(self.client.get(url).send().await?.text().await?)
    }

    /// Runs one read phase, watching what it costs ([`PhaseWatch`]); `endpoint` is
    /// tally-query's name for its reads.
    async fn watched(
        &self,
        endpoint: &'static str,
        phase: impl std::future::Future<Output = anyhow::Result<Latencies>>,
    ) -> anyhow::Result<(Latencies, String)> {
        let query_admin = self.ports.query_admin;
        let watch = PhaseWatch::start(&self.pids(), endpoint, &self.metrics_text(query_admin).await?);
        let latencies = phase.await?;
        Ok((latencies, watch.finish(&self.metrics_text(query_admin).await?)))
    }
}

/// The sum of the values of `metric`'s series in a Prometheus text exposition whose
/// labels (`{…}`, or "" without) pass `labels`.
pub(crate) fn sum_series(text: &str, metric: &str, labels: impl Fn(&str) -> bool) -> f64 {
    find_series(text, metric, labels).unwrap_or(0.0)
}

/// [`sum_series`], or `None` when no series of `metric` passes `labels` (the
/// exposition does not have it, which a sum would read as zero).
pub(crate) fn find_series(text: &str, metric: &str, labels: impl Fn(&str) -> bool) -> Option<f64> {
    text.lines()
        .filter_map(|line| line.strip_prefix(metric).filter(|rest| rest.starts_with([' ', '{'])))
        .filter(|rest| labels(rest.rsplit_once(' ').map_or("", |(labels, _)| labels)))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|sum, value| sum + value)
}

/// Produces a backlog of `case` on the increments topic.
async fn produce_backlog(
    config: &TallyConfig,
    topic: &str,
    case: Case,
    (entities, shape): (usize, Shape),
    seed: u64,
) -> anyhow::Result<()> {
    let producer: FutureProducer = producer_config(&config.kafka)?.create()?;
    let mut draw = Entities::shaped(entities, seed, shape);
    let progress = bar(case.messages as u64, "producing the backlog");
    let mut pending = futures::stream::FuturesUnordered::new();
    use futures::StreamExt;
    for _ in 0..case.messages {
        let (key, payload) = draw.message(case.per_message);
        let producer = producer.clone();
        let topic = topic.to_string();
        pending.push(async move {
            producer.send(FutureRecord::to(&topic).key(&key).payload(&payload), Duration::from_secs(120)).await
        });
        while pending.len() >= 20_000 {
            if let Some(result) = pending.next().await {
                result.map_err(|(err, _)| anyhow::anyhow!("producing: {err}"))?;
                progress.inc(1);
            }
        }
    }
    while let Some(result) = pending.next().await {
        result.map_err(|(err, _)| anyhow::anyhow!("producing: {err}"))?;
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(())
}

/// The raw consume rate: a plain consumer reads every partition of `topic` from its
/// start; records/s from the first record to the last.
async fn raw_consume(config: &TallyConfig, topic: &str, records: usize) -> anyhow::Result<f64> {
    let kafka = config.kafka.clone();
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || -> anyhow::Result<f64> {
        let mut consumer_config = tally_shared::kafka::consumer_config(&kafka)?;
        consumer_config.set("group.id", "tally-bench-raw").set("enable.auto.commit", "false");
        let consumer: BaseConsumer = consumer_config.create()?;
        let partitions = tally_shared::kafka::partition_count(&consumer, &topic, Duration::from_secs(10))?;
        let mut assignment = TopicPartitionList::new();
        for partition in 0..partitions as i32 {
            assignment.add_partition_offset(&topic, partition, Offset::Beginning)?;
        }
        consumer.assign(&assignment)?;
        let progress = bar(records as u64, "raw consume (baseline)");
        let (mut seen, mut first, deadline) = (0usize, None, Instant::now() + Duration::from_secs(600));
        while seen < records {
            anyhow::ensure!(Instant::now() < deadline, "raw consume: {seen} of {records} records in 600 s");
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(_)) => {
                    first.get_or_insert_with(Instant::now);
                    seen += 1;
                    if seen % 1000 == 0 {
                        progress.set_position(seen as u64);
                    }
                }
                Some(Err(err)) => bail!("raw consume: {err}"),
                None => {}
            }
        }
        progress.finish_and_clear();
        let elapsed = first.map_or(Duration::ZERO, |f| f.elapsed()).as_secs_f64();
        Ok((seen.saturating_sub(1)) as f64 / elapsed.max(1e-9))
    })
    .await?
}

/// What an end-to-end run measured.
struct Throughput {
    per_sec: f64,
    /// From the ingester's first record to its having read the whole backlog.
    routed_after: Duration,
    /// The share of the backlog the counter had applied by then.
    applied_when_routed: f64,
    /// From the ingester's first record to the counter having applied everything.
    applied_after: Duration,
    /// The ingester's, the counter's and the local broker's CPU over the same span
    /// (`None` if the ingester was never seen reading).
    cpu: Option<CpuWatch>,
    /// Their CPU seconds together, read when the end was seen.
    cpu_total: Option<f64>,
}

/// Starts the ingester on a backlog (the counter already running) and measures
/// increments/s from the ingester's first record to the counter having applied
/// `expected` increments in total.
/// With `totals`, the end is when the totals other shards relay stopped arriving
/// too (the counter's log read to its end and nothing new for a second).
async fn ingest_backlog(
    rig: &mut Rig,
    expected: u64,
    messages: u64,
    label: &str,
    totals: bool,
) -> anyhow::Result<Throughput> {
    const APPLIED: &str = "tally_counter_applied_increments_total";
    let applied_before = rig.scrape(rig.ports.counter_admin, APPLIED).await?;
    let ingester_admin = rig.ports.ingester_admin;
    rig.run("tally-ingester", ingester_admin).await?;
    let progress = bar(expected, label);
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut first: Option<(Instant, f64, CpuWatch)> = None;
    let mut routed_all: Option<(Duration, f64)> = None;
    loop {
        let applied = rig.scrape(rig.ports.counter_admin, APPLIED).await? - applied_before;
        if first.is_none() || routed_all.is_none() {
            let read = rig.scrape(ingester_admin, "tally_ingester_input_records_total").await?;
            if first.is_none() && read > 0.0 {
                first = Some((Instant::now(), applied, CpuWatch::start(&rig.pids())));
            }
            if let Some((started, at_start, _)) = first.as_ref().filter(|_| read as u64 >= messages) {
                routed_all = Some((started.elapsed(), (applied - at_start) / (expected as f64 - at_start).max(1.0)));
            }
        }
        progress.set_position(applied as u64);
        if applied as u64 >= expected {
            progress.finish_and_clear();
            let (started, at_start, cpu) = match first {
                Some((started, at_start, cpu)) => (started, at_start, Some(cpu)),
                None => (Instant::now(), 0.0, None),
            };
            let (elapsed, cpu_total) = match totals {
                true => relayed_totals_settled(rig, (started, cpu.as_ref()), deadline).await?,
                false => (started.elapsed(), cpu.as_ref().and_then(CpuWatch::total)),
            };
            let (routed_after, applied_when_routed) = routed_all.unwrap_or((elapsed, 1.0));
            return Ok(Throughput {
                per_sec: (applied - at_start) / elapsed.as_secs_f64().max(1e-9),
                routed_after,
                applied_when_routed,
                applied_after: elapsed,
                cpu,
                cpu_total,
            });
        }
        anyhow::ensure!(Instant::now() < deadline, "{label}: {applied} of {expected} increments applied in 900 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// When, since `started`, the counter last applied totals relayed by other shards,
/// once its log is read to the end and none came for a second (polled every 20 ms),
/// and what `cpu` watched had spent by then.
async fn relayed_totals_settled(
    rig: &Rig,
    (started, cpu): (Instant, Option<&CpuWatch>),
    deadline: Instant,
) -> anyhow::Result<(Duration, Option<f64>)> {
    const QUIET: Duration = Duration::from_secs(1);
    let admin = rig.ports.counter_admin;
    let mut last = (f64::NAN, started.elapsed(), None);
    loop {
        let received = rig.scrape_labelled(admin, "tally_counter_graph_entries_total", "remote_total").await?;
        let lag = rig.scrape(admin, "tally_counter_consumer_lag_records").await?;
        if received != last.0 {
            last = (received, started.elapsed(), cpu.and_then(CpuWatch::total));
        } else if lag == 0.0 && started.elapsed() > last.1 + QUIET {
            return Ok((last.1, last.2));
        }
        anyhow::ensure!(Instant::now() < deadline, "relayed totals still arriving at the run's deadline");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn ingest(config: TallyConfig, args: IngestBenchArgs) -> anyhow::Result<()> {
    let cases = args.cases.iter().map(|c| Case::parse(c)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut rig = Rig::start(config).await?;
    println!(
        "ingest bench: backlogs of {} on the increments topic, {} entities (Zipf 1.1){}; broker {}; services as processes from {}",
        args.cases.join(", "),
        args.entities,
        match args.repeat {
            1 => String::new(),
            n => format!(", each case {n} times"),
        },
        match rig.local {
            Some(_) => "a local one, started afresh for each run".to_string(),
            None => rig.config.kafka.bootstrap_servers.clone(),
        },
        harness::sibling_binary("tally-counter")?.parent().unwrap_or(Path::new("?")).display()
    );
    let shapes = &args.shapes;
    let mut ratios: Vec<Vec<Vec<Ratios>>> = vec![vec![Vec::new(); shapes.len()]; cases.len()];
    for round in 0..args.repeat as usize {
        for (i, case) in cases.iter().enumerate() {
            for (j, shape) in shapes.iter().enumerate() {
                let run = (round * cases.len() + i) * shapes.len() + j;
                if run > 0 {
                    rig.fresh_local_broker(run).await?;
                }
                // The same backlog in every round: the seed is the case's.
                ratios[i][j].push(ingest_case(&mut rig, *case, (args.entities, *shape), i as u64).await?);
            }
        }
    }
    if args.repeat > 1 {
        for (case, ratios) in cases.iter().zip(&ratios) {
            for (shape, ratios) in shapes.iter().zip(ratios) {
                let before = Spread::of(ratios.iter().map(|r| r.before));
                let after = Spread::of(ratios.iter().map(|r| r.after));
                println!(
                    "{:>3} {}/message, {shape}, {} runs: tally end to end {} raw before, {} after",
                    case.per_message,
                    case.increment_word(),
                    ratios.len(),
                    before,
                    after
                );
            }
        }
    }
    // Each shape's cost per increment against the zipf backlog's, case by case.
    if let Some(zipf) = shapes.iter().position(|shape| *shape == Shape::Zipf).filter(|_| shapes.len() > 1) {
        for (case, ratios) in cases.iter().zip(&ratios) {
            let cost = |runs: &[Ratios]| Spread::of(runs.iter().filter_map(|r| r.cpu_per_million));
            let rate = |runs: &[Ratios]| Spread::of(runs.iter().map(|r| r.per_sec));
            let (base_cost, base_rate) = (cost(&ratios[zipf]).median, rate(&ratios[zipf]).median);
            for (shape, runs) in shapes.iter().zip(ratios) {
                let (cost, rate) = (cost(runs), rate(runs));
                println!(
                    "{:>3} {}/message, {shape}: {:.2} CPU-s per million increments (all processes; {:.2}x zipf's), {:.0} increments/s ({:.2}x zipf's)",
                    case.per_message,
                    case.increment_word(),
                    cost.median,
                    cost.median / base_cost,
                    rate.median,
                    rate.median / base_rate,
                );
            }
        }
    }
    rig.finish().await
}

/// One run's end-to-end rate against the raw rate before and after it, the rate
/// itself, and the CPU seconds all processes spent per million increments.
#[derive(Debug, Clone, Copy)]
struct Ratios {
    before: f64,
    after: f64,
    per_sec: f64,
    cpu_per_million: Option<f64>,
}

/// The median of several runs' ratios, and their range.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    /// An even count's median is the mean of the middle two.
    fn of(values: impl Iterator<Item = f64>) -> Self {
        let mut sorted: Vec<f64> = values.collect();
        sorted.sort_by(f64::total_cmp);
        let Some((&min, &max)) = sorted.first().zip(sorted.last()) else {
            return Self { median: f64::NAN, min: f64::NAN, max: f64::NAN };
        };
        let mid = sorted.len() / 2;
        let median = match sorted.len() % 2 {
            1 => sorted[mid],
            _ => (sorted[mid - 1] + sorted[mid]) / 2.0,
        };
        Self { median, min, max }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "median {:.2}x ({:.2}-{:.2}x)", self.median, self.min, self.max)
    }
}

/// One run of a case on the rig's broker as it is: the backlog, the raw rate, tally
/// end to end, the raw rate again and the counter's rebuild, each printed.
async fn ingest_case(
    rig: &mut Rig,
    case: Case,
    (entities, shape): (usize, Shape),
    seed: u64,
) -> anyhow::Result<Ratios> {
    let names = rig.fresh_topics().await?;
    if shape == Shape::Subtree {
        crate::shapes::write_subtree(&rig.config, &names, entities).await?;
        println!(
            "    {shape}: {entities} entities under {} (their changes on the shard topic)",
            crate::shapes::ANCESTOR
        );
    }
    produce_backlog(&rig.config, &names.increments(), case, (entities, shape), seed).await?;
    let raw_cpu = CpuWatch::start(
        &[("consumer", std::process::id())].into_iter().chain(rig.broker_process()).collect::<Vec<_>>(),
    );
    let raw = raw_consume(&rig.config, &names.increments(), case.messages).await?;
    let raw_cpu = raw_cpu.per_unit(case.increments() as f64 / 1e6);
    let counter_admin = rig.ports.counter_admin;
    rig.run("tally-counter", counter_admin).await?;
    let label = format!("{} per message, {shape}, end to end", case.per_message);
    let through = ingest_backlog(rig, case.increments(), case.messages as u64, &label, shape == Shape::Subtree).await?;
    let tally_cpu =
        through.cpu.as_ref().map_or_else(|| "unknown".into(), |cpu| cpu.per_unit(case.increments() as f64 / 1e6));
    let cpu_per_million = through.cpu_total.map(|seconds| seconds / (case.increments() as f64 / 1e6));
    if shape == Shape::Subtree {
        // The hierarchy took: every entity's change applied, totals relayed to the ancestor.
        let entries = "tally_counter_graph_entries_total";
        let changes = rig.scrape_labelled(counter_admin, entries, "desc_change").await?;
        let totals = rig.scrape_labelled(counter_admin, entries, "remote_total").await?;
        anyhow::ensure!(changes as usize == entities && totals > 0.0, "{changes} changes applied, {totals} totals");
        println!("    {shape}: {changes:.0} changes of ancestors applied; {totals:.0} totals relayed to the ancestor's shard");
    }
    let rollups = rig.scrape(counter_admin, "tally_counter_rollups_published_total").await?;
    let live_batches = rig.batches(counter_admin).await?;
    let late_records = rig.scrape(counter_admin, "tally_counter_late_records_total").await?;
    let journal = match rig.scrape(counter_admin, "tally_counter_store_wal").await? == 0.0 {
        true => "the shard topic (no WAL)",
        false => "RocksDB's WAL",
    };
    let ingester_admin = rig.ports.ingester_admin;
    let input_bytes = rig.scrape(ingester_admin, "tally_ingester_input_bytes_total").await?;
    let shard_bytes = rig.scrape_labelled(ingester_admin, "tally_ingester_output_bytes_total", &names.shards()).await?;
    rig.stop_all().await?;
    // A broker can slow down as its data grows (the local one does): the raw rate
    // again after the run, and the ratio against both.
    let raw_after = raw_consume(&rig.config, &names.increments(), case.messages).await?;
    let rebuild = rebuild_from_the_log(rig, case.increments()).await?;
    let per = case.per_message as f64;
    let ratios = Ratios {
        before: through.per_sec / (raw * per).max(1e-9),
        after: through.per_sec / (raw_after * per).max(1e-9),
        per_sec: through.per_sec,
        cpu_per_million,
    };
    println!(
        "{:>3} {}/message, {shape}: raw consume {:>9.0} records/s before, {:>9.0} after ({:.0} and {:.0} increments/s); tally end to end {:>9.0} increments/s = {:.2}x raw before, {:.2}x after (the ingester read it all after {:.2} s, when the counter had applied {:.0} %; the counter applied it all after {:.2} s)",
        case.per_message,
        case.increment_word(),
        raw,
        raw_after,
        raw * per,
        raw_after * per,
        through.per_sec,
        ratios.before,
        ratios.after,
        through.routed_after.as_secs_f64(),
        through.applied_when_routed * 100.0,
        through.applied_after.as_secs_f64(),
    );
    println!("    rollup records published by then: {rollups:.0}");
    let increments = case.increments() as f64;
    println!(
        "    bytes per increment: input {:.1}, shard topic {:.1}",
        input_bytes / increments,
        shard_bytes / increments
    );
    println!("    CPU per million increments: tally end to end: {tally_cpu}; raw consume: {raw_cpu}");
    println!(
        "    the counter's write batches: live {}; rebuilding {}",
        live_batches.describe(increments),
        rebuild.batches.describe(increments)
    );
    println!("    the counter's stores journaled by {journal}; {late_records:.0} records joined a batch being applied");
    println!(
        "    the counter alone, rebuilding every shard from the shard topic: {:.0} increments/s ({:.2} s; CPU per million increments: {})",
        case.increments() as f64 / rebuild.elapsed.as_secs_f64().max(1e-9),
        rebuild.elapsed.as_secs_f64(),
        rebuild.cpu,
    );
    Ok(ratios)
}

/// How long the counter took to rebuild its shards from the shard topic alone.
struct Rebuild {
    elapsed: Duration,
    /// The counter's and the broker's CPU per million increments.
    cpu: String,
    batches: Batches,
}

/// The counter's write batches over a run (from its metrics; per shard, so a batch
/// polled across several shards counts once for each).
pub(crate) struct Batches {
    count: f64,
    keys: f64,
    /// Seconds spent applying them, summed over the counter's apply threads (each
    /// shard's batch is timed on the thread that applies it).
    seconds: f64,
    /// Batches of the apply loop (each of one or more shards) applied with helper
    /// threads.
    helped: f64,
}

impl Batches {
    /// The batches after `before` was read.
    pub(crate) fn since(&self, before: &Batches) -> Batches {
        Batches {
            count: self.count - before.count,
            keys: self.keys - before.keys,
            seconds: self.seconds - before.seconds,
            helped: self.helped - before.helped,
        }
    }

    pub(crate) fn describe(&self, increments: f64) -> String {
        format!(
            "{:.0} batches in {:.2} s (summed over the apply threads; {:.0} of the loop's with helpers), {:.0} increments and {:.0} bucket keys written each on average ({:.2} keys per increment)",
            self.count,
            self.seconds,
            self.helped,
            increments / self.count.max(1.0),
            self.keys / self.count.max(1.0),
            self.keys / increments.max(1.0)
        )
    }
}

/// Deletes the (stopped) counter's stores and snapshots and starts it again, with
/// snapshots off: it rebuilds every shard from the shard topic, as a counter that
/// lost its disk does without snapshots. Timed from its start to every increment
/// applied, process start and store opening included; then it is stopped.
async fn rebuild_from_the_log(rig: &mut Rig, expected: u64) -> anyhow::Result<Rebuild> {
    for dir in ["counter", "snapshots"] {
        let path = rig.data_dir().join(dir);
        if path.exists() {
            std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    let started = Instant::now();
    rig.spawn_with("tally-counter", |config| config.snapshots.enabled = false)?;
    let cpu = CpuWatch::start(&rig.pids());
    let progress = bar(expected, "the counter rebuilding");
    let deadline = started + Duration::from_secs(900);
    loop {
        // Not served (nor ready) before it caught up: its metrics answer earlier.
        let applied =
            rig.scrape(rig.ports.counter_admin, "tally_counter_applied_increments_total").await.unwrap_or(0.0);
        progress.set_position(applied as u64);
        if applied as u64 >= expected {
            let elapsed = started.elapsed();
            progress.finish_and_clear();
            let cpu = cpu.per_unit(expected as f64 / 1e6);
            let batches = rig.batches(rig.ports.counter_admin).await?;
            rig.stop("tally-counter").await?;
            return Ok(Rebuild { elapsed, cpu, batches });
        }
        rig.still_running("tally-counter")?;
        let failed = rig.scrape(rig.ports.counter_admin, "tally_counter_failed_shards").await.unwrap_or(0.0);
        anyhow::ensure!(failed == 0.0, "{failed} shards failed while the counter rebuilt them (see its /readyz)");
        anyhow::ensure!(Instant::now() < deadline, "the counter rebuilt {applied} of {expected} increments in 900 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Latencies of one phase, sorted.
pub(crate) struct Latencies(pub(crate) Vec<Duration>);

impl Latencies {
    /// The `p` quantile in ms (1.0: the largest).
    pub(crate) fn at(&self, p: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        crate::jobs::percentile(&self.0, p).as_secs_f64() * 1e3
    }

    fn line(&self, label: &str, seconds: f64) -> String {
        format!(
            "{label:<34} p50 {:>6.2} ms  p99 {:>6.2} ms  p999 {:>6.2} ms  ({} reads, {:.0}/s)",
            self.at(0.50),
            self.at(0.99),
            self.at(0.999),
            self.0.len(),
            self.0.len() as f64 / seconds
        )
    }
}

/// A minimal HTTP/1.1 keep-alive client: one request at a time on one connection.
pub(crate) struct Connection {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

/// How long a bench's read waits for its answer before the bench stops with an
/// error: a read is answered in milliseconds, and a service that holds the
/// connection without answering must not hang the bench.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

impl Connection {
    pub(crate) fn open(port: u16) -> anyhow::Result<Self> {
        Self::open_waiting(port, ANSWER_WITHIN)
    }

    /// A connection whose reads and writes fail after `wait`.
    fn open_waiting(port: u16, wait: Duration) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(wait))?;
        stream.set_write_timeout(Some(wait))?;
        Ok(Self { writer: stream.try_clone()?, reader: BufReader::new(stream) })
    }

    /// Sends `request` (a whole HTTP request) and reads the answer; its status.
    pub(crate) fn exchange(&mut self, request: &[u8], body: &mut Vec<u8>) -> anyhow::Result<u16> {
        self.writer.write_all(request)?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line.split(' ').nth(1).context("no status line")?.parse()?;
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse()?;
                }
            }
        }
        body.resize(length, 0);
        self.reader.read_exact(body)?;
        Ok(status)
    }
}

/// When the requests of one open-loop client are due: every `interval`, from its
/// own start (the clients' starts spread over one interval).
struct Schedule {
    next: Instant,
    interval: Duration,
}

impl Schedule {
    /// Client `client` of `clients` sharing `rate` requests per second from `start`.
    fn new(start: Instant, client: usize, clients: usize, rate: u32) -> Self {
        let interval = Duration::from_secs_f64(clients as f64 / rate as f64);
        Self { next: start + interval.mul_f64(client as f64 / clients as f64), interval }
    }

    /// When the next request is due.
    fn due(&mut self) -> Instant {
        let due = self.next;
        self.next += self.interval;
        due
    }
}

/// Runs `connections` clients for `seconds`: closed loop, or open loop at `rate`
/// requests per second (latencies from when each request was due, [`Schedule`]).
/// Each request is made by `request(rng)`; every answer must be 200. The clients
/// stand for callers on other machines: they ask for the CPU slice the services'
/// request threads ask for (`runtime.latency_slice_us`), so that their own wake-ups
/// on the shared cores weigh on the tail no more than the services' do.
async fn load(
    port: u16,
    clients: (usize, Duration, Option<u32>),
    seconds: u64,
    entities: usize,
    request: fn(&mut Entities) -> Vec<u8>,
    label: &str,
) -> anyhow::Result<Latencies> {
    let (connections, slice, rate) = clients;
    let progress = bar(seconds, label);
    // Connected before the phase starts, so that no client's first request waits
    // for its connection.
    let opened = tokio::task::spawn_blocking(move || {
        (0..connections).map(|_| Connection::open(port)).collect::<anyhow::Result<Vec<Connection>>>()
    });
    let opened = opened.await??;
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let clients: Vec<_> = opened
        .into_iter()
        .enumerate()
        .map(|(c, mut connection)| {
            tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Duration>> {
                // Refused (a sandbox without the call): the clients keep the kernel's.
                tally_shared::sched::set_slice(slice).ok();
                let mut draw = Entities::new(entities, 1_000 + c as u64);
                let (mut latencies, mut body) = (Vec::new(), Vec::new());
                let mut schedule = rate.map(|rate| Schedule::new(start, c, connections, rate));
                loop {
                    let request = request(&mut draw);
                    // Open loop: every request due within the phase is sent, however
                    // late (a client behind its schedule counts its waiting).
                    let started = match &mut schedule {
                        Some(schedule) => {
                            let due = schedule.due();
                            if due >= end {
                                break;
                            }
                            std::thread::sleep(due.saturating_duration_since(Instant::now()));
                            due
                        }
                        None if Instant::now() >= end => break,
                        None => Instant::now(),
                    };
                    let status = connection.exchange(&request, &mut body)?;
                    latencies.push(started.elapsed());
                    anyhow::ensure!(status == 200, "a read answered {status}: {}", String::from_utf8_lossy(&body));
                }
                Ok(latencies)
            })
        })
        .collect();
    while start.elapsed() < Duration::from_secs(seconds) {
        progress.set_position(start.elapsed().as_secs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut all = Vec::new();
    for client in clients {
        all.extend(client.await??);
    }
    progress.finish_and_clear();
    all.sort();
    Ok(Latencies(all))
}

/// The slice the clients' threads (and the services' request threads, on the same
/// kernel) get when they ask for `slice`, as the header says it.
fn clients_slice(slice: Duration) -> String {
    use tally_shared::sched::{ask_for_slice, Asked};
    if slice.is_zero() {
        return "the kernel's default".into();
    }
    match std::thread::spawn(move || ask_for_slice(slice)).join() {
        Ok(Asked::Granted) => format!("{} µs (runtime.latency_slice_us)", slice.as_micros()),
        Ok(Asked::Ignored) => "the kernel's default (it ignores runtime.latency_slice_us: Linux before 6.12)".into(),
        Ok(Asked::Refused(err)) => format!("the kernel's default (runtime.latency_slice_us refused: {err})"),
        Err(_) => "unknown (asking for it panicked)".into(),
    }
}

fn single_read(draw: &mut Entities) -> Vec<u8> {
    format!("GET /v1/counters/user:{}/views HTTP/1.1\r\nhost: bench\r\n\r\n", draw.next()).into_bytes()
}

fn batch_read(draw: &mut Entities) -> Vec<u8> {
    let queries: Vec<String> =
        (0..100).map(|_| format!(r#"{{"entity":"user:{}","metric":"views"}}"#, draw.next())).collect();
    let body = format!(r#"{{"queries":[{}]}}"#, queries.join(","));
    format!(
        "POST /v1/query HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub async fn read(config: TallyConfig, args: ReadBenchArgs) -> anyhow::Result<()> {
    let mut rig = Rig::start(config).await?;
    if rig.config.auth.reader_token.is_some() {
        rig.finish().await?;
        bail!("tally-bench read sends no token: run it with auth.reader_token unset");
    }
    rig.config.counter.rollups = args.rollups;
    let names = rig.fresh_topics().await?;
    let per_message = args.ingest_per_message as usize;
    println!(
        "read bench: {} clients on keep-alive connections, {}, {} s per phase, {} entities (Zipf 1.1); while ingesting: a steady load of {}-increment messages; rollups {}; broker {}; CPU slice of request threads and clients: {}",
        args.connections,
        match args.rate {
            Some(rate) => format!(
                "open loop at {rate} single reads/s and {} batches/s (latency from when each was due)",
                batch_rate(&args).unwrap_or(1)
            ),
            None => "closed loop".into(),
        },
        args.seconds,
        args.entities,
        per_message,
        if args.rollups { "published" } else { "off (--rollups to publish them)" },
        rig.config.kafka.bootstrap_servers,
        clients_slice(rig.config.runtime.latency_slice())
    );
    // Every entity exists (and more counts on the popular ones); the warm-up's apply
    // rate is the capacity the steady load is a share of.
    let warm = Case { per_message, messages: args.warm_messages.max((args.entities * 3).div_ceil(per_message)) };
    produce_backlog(&rig.config, &names.increments(), warm, (args.entities, Shape::Zipf), 7).await?;
    let (counter_admin, query_admin) = (rig.ports.counter_admin, rig.ports.query_admin);
    rig.run("tally-counter", counter_admin).await?;
    let capacity =
        ingest_backlog(&mut rig, warm.increments(), warm.messages as u64, "writing the counters", false).await?;
    let offered = args.ingest_rate.unwrap_or((capacity.per_sec / 2.0) as u64).max(1);
    println!(
        "capacity (the warm-up's apply rate): {:.0} increments/s; offered while ingesting: {offered} increments/s",
        capacity.per_sec
    );
    rig.run("tally-query", query_admin).await?;
    // Idle: nothing written for a while, the counter at rest (`shared::rest`: no
    // fetches), which it reaches `REST_AFTER` after its last record.
    let settling = Instant::now();
    let bound = tally_shared::rest::REST_AFTER + Duration::from_secs(5);
    while rig.scrape(counter_admin, "tally_counter_fetch_resting").await? != 1.0 && settling.elapsed() < bound {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let resting = rig.scrape(counter_admin, "tally_counter_fetch_resting").await? == 1.0;
    println!(
        "idle phases from {:.1} s after the counters were written ({})",
        settling.elapsed().as_secs_f64(),
        if resting { "the counter resting" } else { "the counter not resting" }
    );
    let (port, secs) = (rig.ports.query, args.seconds);
    let (conns, entities) = ((args.connections, rig.config.runtime.latency_slice(), args.rate), args.entities);
    let batch_conns = (conns.0, conns.1, batch_rate(&args));

    let idle_single =
        rig.watched("counter", load(port, conns, secs, entities, single_read, "single reads, idle")).await?;
    let idle_batch =
        rig.watched("batch", load(port, batch_conns, secs, entities, batch_read, "batches of 100, idle")).await?;

    // Busy: a steady load flows (a few seconds first, to be steady), reads run.
    const APPLIED: &str = "tally_counter_applied_increments_total";
    let steady = SteadyLoad::start(&rig.config, names.increments(), offered, per_message, args.entities)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    const READ: &str = "tally_ingester_input_records_total";
    let read_before = rig.scrape(rig.ports.ingester_admin, READ).await?;
    let delivered_before = steady.delivered();
    let (before, before_at) = (rig.scrape(counter_admin, APPLIED).await?, Instant::now());
    let busy_single =
        rig.watched("counter", load(port, conns, secs, entities, single_read, "single reads, ingesting")).await?;
    let (between, between_at) = (rig.scrape(counter_admin, APPLIED).await?, Instant::now());
    let busy_batch =
        rig.watched("batch", load(port, batch_conns, secs, entities, batch_read, "batches of 100, ingesting")).await?;
    let (after, after_at) = (rig.scrape(counter_admin, APPLIED).await?, Instant::now());
    let read = (rig.scrape(rig.ports.ingester_admin, READ).await? - read_before) * per_message as f64;
    let delivered = steady.delivered() - delivered_before;
    let resting = (
        rig.scrape(rig.ports.ingester_admin, "tally_ingester_fetch_resting").await? == 1.0,
        rig.scrape(counter_admin, "tally_counter_fetch_resting").await? == 1.0,
    );
    let sent = steady.stop().await?;
    rig.finish().await?;

    let s = secs as f64;
    let applied_single = (between - before) / (between_at - before_at).as_secs_f64();
    let applied_batch = (after - between) / (after_at - between_at).as_secs_f64();
    println!(
        "while ingesting: {sent} increments sent in all; in the two phases the broker acknowledged {delivered} (≈ {:.0}/s) and the ingester read {read:.0} (≈ {:.0}/s); at their end the ingester {} and the counter {}",
        delivered as f64 / (after_at - before_at).as_secs_f64(),
        read / (after_at - before_at).as_secs_f64(),
        if resting.0 { "rested" } else { "fetched" },
        if resting.1 { "rested" } else { "fetched" }
    );
    for ((latencies, cost), label, applied) in [
        (idle_single, "single read, idle", None),
        (idle_batch, "batch of 100, idle", None),
        (busy_single, "single read, while ingesting", Some(applied_single)),
        (busy_batch, "batch of 100, while ingesting", Some(applied_batch)),
    ] {
        match applied {
            Some(applied) if applied < 0.9 * offered as f64 => println!(
                "{label:<34} no figure: {applied:.0} increments/s applied of {offered} offered (under 90 %: not a while-ingesting phase)\n{cost}"
            ),
            Some(applied) => println!("{}  [{applied:.0} of {offered} increments/s applied]\n{cost}", latencies.line(label, s)),
            None => println!("{}\n{cost}", latencies.line(label, s)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pace hands out exactly the messages of its rate, fractions carried over.
    #[test]
    fn a_pace_owes_what_its_rate_says() {
        let mut pace = Pace::new(1_000, 4); // 250 messages a second
        let start = pace.last;
        let dues: Vec<u64> =
            [1, 2, 4, 1_000].iter().map(|ms| pace.due_at(start + Duration::from_millis(*ms))).collect();
        assert_eq!(dues, vec![0, 0, 1, 249], "quarters carried until whole");
        assert_eq!(pace.due_at(start + Duration::from_millis(3_000)), 500, "750 in 3 s in all");
    }

    /// Each case after the first gets an empty broker: the one before is stopped and
    /// its data deleted, and the config points at the new one, which knows none of
    /// the old one's topics.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_case_after_the_first_gets_an_empty_local_broker() {
        let scratch = tempfile::tempdir().unwrap();
        let mut config = TallyConfig::default();
        config.kafka.bootstrap_servers.clear();
        let mut local = local_broker_unless_configured(&mut config, scratch.path()).await.unwrap();
        let first = local.as_ref().unwrap();
        let (first_pid, first_servers) = (first.pid(), config.kafka.bootstrap_servers.clone());
        assert!(scratch.path().join("kafka").join("tansu.db").exists());
        let names = TopicNames::new(&config.kafka.topic_prefix);
        let declarations = Declarations::load(None).unwrap();
        let mut declared: Vec<String> = declarations.topics.iter().map(|decl| names.name(&decl.name)).collect();
        declared.sort();
        topics::apply(&config.kafka, &declarations).await.unwrap();
        let topics_of = |servers: String| {
            let mut client = rdkafka::ClientConfig::new();
            let consumer: BaseConsumer = client.set("bootstrap.servers", servers).create().unwrap();
            let metadata = consumer.fetch_metadata(None, Duration::from_secs(10)).unwrap();
            let mut topics = metadata.topics().iter().map(|t| t.name().to_string()).collect::<Vec<_>>();
            topics.sort();
            topics
        };
        let before = tokio::task::spawn_blocking({
            let servers = first_servers.clone();
            move || topics_of(servers)
        })
        .await
        .unwrap();
        assert_eq!(before, declared);

        replace_local_broker(&mut local, &mut config, scratch.path().join("kafka-1")).await.unwrap();

        let second = local.as_ref().unwrap();
        assert_ne!(second.pid(), first_pid);
        assert_ne!(config.kafka.bootstrap_servers, first_servers);
        assert_eq!(second.bootstrap_servers, config.kafka.bootstrap_servers);
        // SAFETY: kill(2) with signal 0 only asks whether the process exists.
        assert_ne!(unsafe { libc::kill(first_pid as libc::pid_t, 0) }, 0, "the first broker still runs");
        assert!(!scratch.path().join("kafka").exists(), "the first broker's data is still there");
        let servers = config.kafka.bootstrap_servers.clone();
        let after = tokio::task::spawn_blocking(move || topics_of(servers)).await.unwrap();
        assert_eq!(after, Vec::<String>::new(), "the new broker has topics");
    }

    #[test]
    fn a_read_that_is_never_answered_fails_instead_of_hanging() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // Accepts, reads the request and never answers; holds the connection until
        // told (a close would fail the read for another reason).
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 256];
            std::io::Read::read(&mut stream, &mut request).ok();
            stopped.recv().ok();
        });
        let mut connection = Connection::open_waiting(port, Duration::from_millis(200)).unwrap();
        let (done, result) = std::sync::mpsc::channel();
        let started = Instant::now();
        std::thread::spawn(move || {
            let mut body = Vec::new();
            done.send(connection.exchange(b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n", &mut body).is_err()).ok();
        });
        let failed = result.recv_timeout(Duration::from_secs(3)).expect("the read still waits after 3 s");
        assert!(failed, "a read nobody answered succeeded");
        assert!(started.elapsed() < Duration::from_secs(2), "it failed after {:?}", started.elapsed());
        stop.send(()).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn open_loop_clients_share_the_rate_evenly_and_keep_their_schedule() {
        let start = Instant::now();
        let ms = |at: Instant| (at - start).as_secs_f64() * 1e3;
        // 1 000 requests/s over 4 clients: each every 4 ms, their starts 1 ms apart.
        let dues: Vec<Vec<f64>> = (0..4)
            .map(|client| {
                let mut schedule = Schedule::new(start, client, 4, 1_000);
                (0..3).map(|_| ms(schedule.due())).collect()
            })
            .collect();
        let want: Vec<Vec<f64>> =
            vec![vec![0.0, 4.0, 8.0], vec![1.0, 5.0, 9.0], vec![2.0, 6.0, 10.0], vec![3.0, 7.0, 11.0]];
        assert_eq!(dues.len(), want.len());
        for (got, want) in dues.iter().zip(&want) {
            assert_eq!(got.len(), want.len());
            for (got, want) in got.iter().zip(want) {
                assert!((got - want).abs() < 1e-6, "{dues:?}");
            }
        }
    }

    #[test]
    fn a_spread_is_the_median_and_the_range_of_its_runs() {
        let odd = Spread::of([0.93, 0.81, 0.90].into_iter());
        assert_eq!(odd, Spread { median: 0.90, min: 0.81, max: 0.93 });
        let even = Spread::of([0.95, 0.80, 0.91, 0.89].into_iter());
        assert_eq!((even.min, even.max), (0.80, 0.95));
        assert!((even.median - 0.90).abs() < 1e-12, "{even:?}");
        assert_eq!(Spread::of([0.5].into_iter()), Spread { median: 0.5, min: 0.5, max: 0.5 });
        assert_eq!(even.to_string(), "median 0.90x (0.80-0.95x)");
        assert!(Spread::of(std::iter::empty()).median.is_nan());
    }

    #[test]
    fn sums_the_series_of_one_metric_whose_labels_pass() {
        let text = "# HELP tally_x_total x\n\
                    tally_x_total{topic=\"a\"} 5\n\
                    tally_x_total{topic=\"b\"} 7\n\
                    tally_x_total_more 100\n\
                    tally_x_totals 1000\n\
                    tally_y 3\n";
        assert_eq!(sum_series(text, "tally_x_total", |_| true), 12.0);
        assert_eq!(sum_series(text, "tally_x_total", |labels| labels.contains("=\"b\"")), 7.0);
        assert_eq!(sum_series(text, "tally_y", |labels| labels.is_empty()), 3.0);
        assert_eq!(sum_series(text, "tally_z", |_| true), 0.0);
    }
}

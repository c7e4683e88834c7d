//! `tally up`: the whole pipeline on one machine.
//!
//! Starts a local broker when no bootstrap servers are configured (data under
//! `./data/kafka`), applies the topics, runs every service as its own process with
//! data under `./data` and its config written to `./data/run/<service>.toml`, restarts
//! a service that dies (with backoff, and says so), and
//! on Ctrl-C stops the services gracefully (SIGTERM, each persists its batch), then
//! the broker. A second `tally up` resumes with the data intact.
//!
//! `--counters N` runs N counter processes that share the shards through the
//! counters' membership (`counter-0` … with data in `counter-0/` …); one counter
//! owns every shard statically on the local broker (on another Kafka, as configured).
//! `--standbys K` gives each shard K standbys among them.

use std::path::{Path, PathBuf};

use anyhow::Context;
use tally_shared::config::TallyConfig;
use tally_shared::harness;
use tally_shared::topics::{self, Declarations};

#[derive(clap::Args)]
pub struct UpArgs {
    /// Where the broker's and the services' data live.
    #[arg(long, default_value = "data")]
    pub data_dir: PathBuf,
    /// Port of the local broker (used only when no bootstrap servers are configured).
    #[arg(long, default_value_t = 9092)]
    pub kafka_port: u16,
    /// Counter processes sharing the shards (a killed or paused one's shards move
    /// to the others within seconds).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub counters: u32,
    /// Standbys per shard (`counter.standby_replicas`): other counters keep a copy
    /// applied, so a killed or paused owner's shards are served again without a
    /// restore. Needs `--counters` 2 or more.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=4))]
    pub standbys: Option<u32>,
}

const SERVICES: [&str; 4] = ["tally-ingester", "tally-graph", "tally-query", "tally-broker"];

pub async fn run(mut config: TallyConfig, args: UpArgs) -> anyhow::Result<()> {
    if let Some(standbys) = args.standbys {
        config.counter.standby_replicas = standbys;
    }
    if config.counter.standby_replicas > 0 && args.counters < 2 {
        anyhow::bail!("standbys need other counters to live on: run with --counters 2 or more");
    }
    let shutdown = tally_shared::shutdown::on_signals();
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)?;

    let broker =
        harness::local_broker_unless_configured(&mut config, data_dir.join("kafka"), Some(args.kafka_port)).await?;
    if let Some(broker) = &broker {
        println!(
            "tally: local Kafka-protocol broker (Tansu) on {} — data in {}",
            broker.bootstrap_servers,
            data_dir.join("kafka").display()
        );
    }

    let declarations = Declarations::load(config.broker.declarations.as_deref())?
        .with_log_retention(config.snapshots.log_retention_ms());
    let actions = topics::apply(&config.kafka, &declarations).await.context("applying topics")?;
    let created = actions.iter().filter(|a| matches!(a, topics::Action::Create { .. })).count();
    println!("tally: topics ready ({created} created)");

    // A service left at its default data dir keeps its data under `--data-dir`.
    let under_data_dir = |configured: &mut PathBuf, default: &str| {
        if *configured == Path::new("data").join(default) {
            *configured = data_dir.join(default);
        }
    };
    under_data_dir(&mut config.counter.data_dir, "counter");
    under_data_dir(&mut config.graph.data_dir, "graph");
    under_data_dir(&mut config.snapshots.dir, "snapshots");
    if broker.is_some() {
        // The local broker's group coordinator never evicts a member killed with -9,
        // so the single local ingester owns every partition without a group.
        config.ingester.static_assignment = true;
    }
    let counters = counter_instances(&config, args.counters, broker.is_some())?;

    println!("tally: read API and dashboard  http://{0}/  (job queues console: http://{0}/jobs)", config.query.listen);
    println!("tally: job queues (dequeue brokers)  http://{}/v1/queues", config.broker.listen);
    let counter_metrics: Vec<String> =
        counters.iter().map(|counter| format!("http://{}/metrics", counter.config.counter.admin_listen)).collect();
    println!(
        "tally: metrics  ingester http://{}/metrics  counter {}  graph http://{}/metrics  query http://{}/metrics  broker http://{}/metrics",
        config.ingester.admin_listen, counter_metrics.join(" "), config.graph.admin_listen, config.query.admin_listen, config.broker.admin_listen
    );
    println!("tally: roles: {}", config.auth.describe_open_roles());
    println!("tally: try  tally produce increment answer:42 views;  tally produce edge add answer:42 user:7;  tally query user:7 views   (Ctrl-C stops everything)");

    // Each service's config file (owner-only: it may hold tokens).
    let run_dir = data_dir.join("run");
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let mut services = SERVICES
        .iter()
        .map(|name| harness::Service::sibling(name, config.clone()))
        .collect::<Result<Vec<_>, _>>()
        .context("locating the service binaries")?;
    services.extend(counters);
    let supervisors: Vec<_> = services
        .into_iter()
        .map(|service| tokio::spawn(harness::supervise(service, run_dir.clone(), shutdown.clone())))
        .collect();
    for supervisor in supervisors {
        if let Err(err) = supervisor.await {
            eprintln!("tally: a supervisor failed: {err}");
        }
    }
    if let Some(mut broker) = broker {
        tokio::task::spawn_blocking(move || broker.stop()).await?;
    }
    println!("tally: stopped");
    Ok(())
}

/// The counter processes to run: one (owning every shard statically on the local
/// broker; as configured on another Kafka), or `n` that share the shards through
/// their membership, each with its own name, data directory (`<counter dir>-<i>`),
/// admin port (counter-i: the configured one plus 10 × i, clear of the other
/// services' defaults) and read port (plus i, unless 0).
fn counter_instances(config: &TallyConfig, n: u32, local_broker: bool) -> anyhow::Result<Vec<harness::Service>> {
    let binary = harness::sibling_binary("tally-counter").context("locating the service binaries")?;
    let counter = |name: String, config: TallyConfig| harness::Service { name, binary: binary.clone(), config };
    if n == 1 {
        let mut config = config.clone();
        if local_broker {
            config.counter.static_assignment = true;
        }
        return Ok(vec![counter("tally-counter".to_string(), config)]);
    }
    let offset = |listen: &str, by: u32| -> Option<String> {
        let mut addr: std::net::SocketAddr = listen.parse().ok().filter(|a: &std::net::SocketAddr| a.port() != 0)?;
        addr.set_port(u16::try_from(by).ok().and_then(|by| addr.port().checked_add(by)).unwrap_or(0));
        Some(addr.to_string())
    };
    Ok((0..n)
        .map(|i| {
            let name = format!("counter-{i}");
            let mut own = config.clone();
            let dir = &config.counter.data_dir;
            own.counter.data_dir = dir
                .with_file_name(format!("{}-{i}", dir.file_name().map_or("counter".into(), |f| f.to_string_lossy())));
            own.counter.static_assignment = false;
            own.counter.instance = name.clone();
            if let Some(addr) = offset(&config.counter.admin_listen, 10 * i) {
                own.counter.admin_listen = addr;
            }
            if let Some(addr) = offset(&config.counter.read_listen, i) {
                own.counter.read_listen = addr;
            }
            counter(format!("tally-counter ({name})"), own)
        })
        .collect())
}

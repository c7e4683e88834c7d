//! `tally up`: the whole pipeline on one machine.
//!
//! Starts a local broker when no bootstrap servers are configured (data under
//! `./data/kafka`), applies the topics, runs every service as its own process with
//! data under `./data`, restarts a service that dies (with backoff, and says so), and
//! on Ctrl-C stops the services gracefully (SIGTERM, each persists its batch), then
//! the broker. A second `tally up` resumes with the data intact.
//!
//! `--counters N` runs N counter processes that share the shards through the
//! counters' membership (`counter-0` … with data in `counter-0/` …); one counter
//! owns every shard statically on the local broker (on another Kafka, as configured).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use tally_shared::config::TallyConfig;
use tally_shared::local_broker::{ensure_installed, LocalBroker};
use tally_shared::topics::{self, Declarations};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

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
}

const SERVICES: [&str; 4] = ["tally-ingester", "tally-graph", "tally-query", "tally-broker"];

pub async fn run(mut config: TallyConfig, config_path: Option<PathBuf>, args: UpArgs) -> anyhow::Result<()> {
    let shutdown = tally_shared::shutdown::on_signals();
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)?;

    let mut broker = None;
    if config.kafka.bootstrap_servers.trim().is_empty() {
        let kafka_dir = data_dir.join("kafka");
        let port = args.kafka_port;
        let started = tokio::task::spawn_blocking(move || -> anyhow::Result<LocalBroker> {
            let binary = ensure_installed()?;
            Ok(LocalBroker::start(&binary, port, &kafka_dir)?)
        })
        .await??;
        println!(
            "tally: local Kafka-protocol broker (Tansu) on {} — data in {}",
            started.bootstrap_servers,
            data_dir.join("kafka").display()
        );
        config.kafka.bootstrap_servers = started.bootstrap_servers.clone();
        broker = Some(started);
    }

    let declarations = Declarations::load(config.broker.declarations.as_deref())?
        .with_log_retention(config.snapshots.log_retention_ms());
    let actions = topics::apply(&config.kafka, &declarations).await.context("applying topics")?;
    let created = actions.iter().filter(|a| matches!(a, topics::Action::Create { .. })).count();
    println!("tally: topics ready ({created} created)");

    // A service left at its default data dir keeps its data under `--data-dir`.
    let under_data_dir = |configured: &Path, default: &str| {
        if configured == Path::new("data").join(default) {
            data_dir.join(default)
        } else {
            configured.to_path_buf()
        }
    };
    let counter_dir = under_data_dir(&config.counter.data_dir, "counter");
    let graph_dir = under_data_dir(&config.graph.data_dir, "graph");
    let snapshots_dir = under_data_dir(&config.snapshots.dir, "snapshots");
    let mut env = vec![
        ("TALLY__KAFKA__BOOTSTRAP_SERVERS".to_string(), config.kafka.bootstrap_servers.clone()),
        ("TALLY__COUNTER__DATA_DIR".to_string(), counter_dir.display().to_string()),
        ("TALLY__GRAPH__DATA_DIR".to_string(), graph_dir.display().to_string()),
        ("TALLY__SNAPSHOTS__DIR".to_string(), snapshots_dir.display().to_string()),
    ];
    if broker.is_some() {
        // The local broker's group coordinator never evicts a member killed with -9,
        // so the single local ingester owns every partition without a group.
        env.push(("TALLY__INGESTER__STATIC_ASSIGNMENT".to_string(), "true".to_string()));
    }
    let counters = counter_instances(&config, &counter_dir, args.counters, broker.is_some());
    if let Some(path) = &config_path {
        env.push(("TALLY_CONFIG".to_string(), std::fs::canonicalize(path)?.display().to_string()));
    }
    let bin_dir = std::env::current_exe()?.parent().map(Path::to_path_buf).context("locating the service binaries")?;

    println!("tally: read API and dashboard  http://{0}/  (job queues console: http://{0}/jobs)", config.query.listen);
    println!("tally: job queues (dequeue brokers)  http://{}/v1/queues", config.broker.listen);
    let counter_metrics: Vec<String> =
        counters.iter().map(|(_, env)| format!("http://{}/metrics", admin_listen_of(env, &config))).collect();
    println!(
        "tally: metrics  ingester http://{}/metrics  counter {}  graph http://{}/metrics  query http://{}/metrics  broker http://{}/metrics",
        config.ingester.admin_listen, counter_metrics.join(" "), config.graph.admin_listen, config.query.admin_listen, config.broker.admin_listen
    );
    println!("tally: roles: {}", config.auth.describe_open_roles());
    println!("tally: try  tally produce increment answer:42 views;  tally produce edge add answer:42 user:7;  tally query user:7 views   (Ctrl-C stops everything)");

    let mut supervisors: Vec<_> = SERVICES
        .iter()
        .map(|name| tokio::spawn(supervise(name.to_string(), bin_dir.join(name), env.clone(), shutdown.clone())))
        .collect();
    for (name, own) in counters {
        let env = env.iter().cloned().chain(own).collect();
        supervisors.push(tokio::spawn(supervise(name, bin_dir.join("tally-counter"), env, shutdown.clone())));
    }
    for supervisor in supervisors {
        let _ = supervisor.await;
    }
    if let Some(mut broker) = broker {
        tokio::task::spawn_blocking(move || broker.stop()).await?;
    }
    println!("tally: stopped");
    Ok(())
}

/// The counter processes to run (name, own environment): one (owning every shard
/// statically on the local broker; as configured on another Kafka), or `n` that
/// share the shards through their membership, each with its own name, data
/// directory (`<counter dir>-<i>`), admin port (counter-i: the configured one plus
/// 10 × i, clear of the other services' defaults) and read port (plus i, unless 0).
fn counter_instances(
    config: &TallyConfig,
    counter_dir: &Path,
    n: u32,
    local_broker: bool,
) -> Vec<(String, Vec<(String, String)>)> {
    if n == 1 {
        let env = match local_broker {
            true => vec![("TALLY__COUNTER__STATIC_ASSIGNMENT".to_string(), "true".to_string())],
            false => Vec::new(),
        };
        return vec![("tally-counter".to_string(), env)];
    }
    let offset = |listen: &str, by: u32| -> Option<String> {
        let mut addr: std::net::SocketAddr = listen.parse().ok().filter(|a: &std::net::SocketAddr| a.port() != 0)?;
        addr.set_port(u16::try_from(by).ok().and_then(|by| addr.port().checked_add(by)).unwrap_or(0));
        Some(addr.to_string())
    };
    (0..n)
        .map(|i| {
            let name = format!("counter-{i}");
            let dir = counter_dir.with_file_name(format!(
                "{}-{i}",
                counter_dir.file_name().map_or("counter".into(), |f| f.to_string_lossy())
            ));
            let mut env = vec![
                ("TALLY__COUNTER__STATIC_ASSIGNMENT".to_string(), "false".to_string()),
                ("TALLY__COUNTER__INSTANCE".to_string(), name.clone()),
                ("TALLY__COUNTER__DATA_DIR".to_string(), dir.display().to_string()),
            ];
            if let Some(addr) = offset(&config.counter.admin_listen, 10 * i) {
                env.push(("TALLY__COUNTER__ADMIN_LISTEN".to_string(), addr));
            }
            if let Some(addr) = offset(&config.counter.read_listen, i) {
                env.push(("TALLY__COUNTER__READ_LISTEN".to_string(), addr));
            }
            (format!("tally-counter ({name})"), env)
        })
        .collect()
}

/// The admin address a counter's environment gives it.
fn admin_listen_of(env: &[(String, String)], config: &TallyConfig) -> String {
    env.iter()
        .find(|(key, _)| key == "TALLY__COUNTER__ADMIN_LISTEN")
        .map_or_else(|| config.counter.admin_listen.clone(), |(_, value)| value.clone())
}

/// Keeps one service running until `shutdown`, restarting it with backoff.
async fn supervise(name: String, binary: PathBuf, env: Vec<(String, String)>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_secs(1);
    loop {
        let mut child = match Command::new(&binary).envs(env.iter().cloned()).kill_on_drop(true).spawn() {
            Ok(child) => child,
            Err(err) => {
                eprintln!("tally: cannot start {name} ({}): {err}", binary.display());
                return;
            }
        };
        let started = Instant::now();
        tokio::select! {
            status = child.wait() => {
                if shutdown.is_cancelled() {
                    return;
                }
                if started.elapsed() > Duration::from_secs(60) {
                    backoff = Duration::from_secs(1);
                }
                let status = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                eprintln!("tally: {name} exited ({status}); restarting in {}s", backoff.as_secs());
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
            _ = shutdown.cancelled() => {
                stop(&name, &mut child).await;
                return;
            }
        }
    }
}

/// SIGTERM, then SIGKILL after 20 s.
pub(crate) async fn stop(name: &str, child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(Duration::from_secs(20), child.wait()).await.is_err() {
        eprintln!("tally: {name} did not stop within 20 s; killing it");
        let _ = child.kill().await;
    }
}

//! `tally`, the command line: `up` runs the whole pipeline on one machine; the other
//! subcommands apply topics, produce test input, read counters and jobs, and act on shards
//! and snapshots. Benchmarks are `tally-bench`'s (the `bench/` crate).

pub mod jobs;
pub mod shards;
pub mod snapshots;
pub mod up;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_core::position::token::{TokenTopic, WriteToken};
use tally_core::trace::{Span, SpanKind};
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{producer_config, TopicNames};
use tally_shared::otel;
use tally_shared::topics::{self, Action, Declarations};

#[derive(Parser)]
#[command(name = "tally", version, about = "Real-time hierarchical counters and job queues on Kafka")]
struct Cli {
    /// The TOML config (also $TALLY_CONFIG); TALLY__SECTION__KEY variables override it.
    #[arg(long, short, global = true, env = "TALLY_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole pipeline on this machine (a local broker when none is configured).
    Up(up::UpArgs),
    /// Manage the declared topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Produce test input.
    Produce {
        /// Print only the write token (for `tally query --after`, `after=`).
        #[arg(long)]
        print_token: bool,
        #[command(subcommand)]
        command: ProduceCommand,
    },
    /// Read a counter through tally-query.
    Query(QueryArgs),
    /// List an entity's neighbours in the graph through tally-query.
    Graph(GraphArgs),
    /// Job queues: enqueue, stats, dead jobs.
    Jobs {
        #[command(subcommand)]
        command: jobs::JobsCommand,
    },
    /// Operator actions on counter shards (move a failed shard past a record).
    Shards {
        #[command(subcommand)]
        command: shards::ShardsCommand,
    },
    /// Snapshot every counter shard now and wait until stored (`list`: every snapshot).
    Snapshot {
        #[command(subcommand)]
        command: Option<snapshots::SnapshotCommand>,
    },
    /// Disaster recovery: restore the newest snapshot of every shard and of the graph
    /// into an empty data directory.
    Restore(snapshots::RestoreArgs),
    /// Check a config as a service would load it.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load the config exactly as a service does (the file, then TALLY__SECTION__KEY
    /// variables) and print the effective config with secrets redacted; exit 1 with
    /// the loader's message when it is not valid.
    Check,
}

#[derive(Subcommand)]
enum TopicsCommand {
    /// Create missing topics and raise partition counts; report drift.
    Apply {
        /// A declarations file on top of the built-in ones (default: the config's
        /// `broker.declarations`).
        #[arg(long)]
        file: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum ProduceCommand {
    /// Produce one increment to the increments topic.
    Increment {
        entity: String,
        metric: String,
        #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
        delta: i64,
        /// Event time, ms since the epoch (default: now).
        #[arg(long)]
        ts: Option<i64>,
        /// Idempotency key.
        #[arg(long)]
        id: Option<String>,
        /// A segment, `dimension=value` (repeat for several): the metric must declare the
        /// dimension (`counting.dimensions`).
        #[arg(long = "segment", value_parser = dimension_and_value)]
        segments: Vec<(String, String)>,
    },
    /// Produce one graph update (`add` or `remove` the edge from → to) to the graph topic.
    Edge {
        #[arg(value_parser = ["add", "remove"])]
        op: String,
        from: String,
        to: String,
        /// Idempotency key.
        #[arg(long)]
        id: Option<String>,
    },
}

#[derive(clap::Args)]
struct GraphArgs {
    entity: String,
    /// descendants (out-edges) or ancestors (in-edges).
    #[arg(long, default_value = "descendants")]
    direction: String,
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// tally-query's base URL (default: from the config's query.listen).
    #[arg(long)]
    url: Option<String>,
}

#[derive(clap::Args)]
struct QueryArgs {
    entity: String,
    metric: String,
    /// A duration (90s, 15m, 24h, 7d) or `all`.
    #[arg(long, default_value = "all")]
    window: String,
    /// total or direct.
    #[arg(long, default_value = "total")]
    kind: String,
    /// Read a series instead of one window.
    #[arg(long)]
    series: bool,
    #[arg(long, default_value = "1h")]
    step: String,
    #[arg(long, default_value = "24h")]
    range: String,
    /// Only data at most this old, else a 503 `too_stale` at once.
    #[arg(long)]
    max_staleness_ms: Option<i64>,
    /// Only once the read holds these writes (tokens `tally produce` printed;
    /// repeat or separate with commas), else a 504 `not_fresh_enough`.
    #[arg(long, value_delimiter = ',')]
    after: Vec<String>,
    /// How long to wait for `--after` (default 10 000).
    #[arg(long)]
    max_wait_ms: Option<i64>,
    /// A segment filter, `dimension=value` or `dimension=*` (any value); repeat for several.
    #[arg(long = "segment", value_parser = dimension_and_value)]
    segments: Vec<(String, String)>,
    /// Break the answer down by this dimension (largest first).
    #[arg(long)]
    by: Option<String>,
    /// tally-query's base URL (default: from the config's query.listen).
    #[arg(long)]
    url: Option<String>,
}

/// `dimension=value`, split.
fn dimension_and_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((dimension, value)) if !dimension.is_empty() => Ok((dimension.to_string(), value.to_string())),
        _ => Err(format!("{text:?}: expected dimension=value")),
    }
}

/// Whether `args` (the words after `tally`) is a command line `tally` accepts; the
/// parser's message when not.
pub fn check_command_line(args: &[String]) -> Result<(), String> {
    let words = std::iter::once("tally".to_string()).chain(args.iter().cloned());
    match Cli::try_parse_from(words) {
        Ok(_) => Ok(()),
        // `--help` and `--version` are accepted: clap answers them with an "error".
        Err(err)
            if matches!(err.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) =>
        {
            Ok(())
        }
        Err(err) => Err(err.to_string()),
    }
}

pub fn main() -> ExitCode {
    tally_shared::service::command_main("tally", dispatch(Cli::parse()))
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Command::Config { command: ConfigCommand::Check } = cli.command {
        return config_check(cli.config.as_deref());
    }
    let config = TallyConfig::load(cli.config.as_deref())?;
    match cli.command {
        Command::Up(args) => up::run(config, args).await,
        Command::Topics { command: TopicsCommand::Apply { file } } => topics_apply(&config, file).await,
        Command::Produce {
            print_token,
            command: ProduceCommand::Increment { entity, metric, delta, ts, id, segments },
        } => {
            let mut body = serde_json::json!({"entity": entity, "metric": metric, "delta": delta});
            if let Some(ts) = ts {
                body["ts"] = ts.into();
            }
            if let Some(id) = id {
                body["id"] = id.into();
            }
            if !segments.is_empty() {
                body["segments"] = segments.into_iter().map(|(d, v)| (d, serde_json::Value::from(v))).collect();
            }
            let topic = TopicNames::new(&config.kafka.topic_prefix).increments();
            produce(&config, (&topic, TokenTopic::Increments), &entity, &serde_json::to_vec(&body)?, print_token).await
        }
        Command::Produce { print_token, command: ProduceCommand::Edge { op, from, to, id } } => {
            let mut body = serde_json::json!({"op": format!("{op}_edge"), "from": from, "to": to});
            if let Some(id) = id {
                body["id"] = id.into();
            }
            // Keyed by `from`: one entity's graph updates stay in order.
            let topic = TopicNames::new(&config.kafka.topic_prefix).graph();
            produce(&config, (&topic, TokenTopic::Graph), &from, &serde_json::to_vec(&body)?, print_token).await
        }
        Command::Graph(args) => graph(&config, args).await,
        Command::Config { command: ConfigCommand::Check } => config_check(cli.config.as_deref()),
        Command::Jobs { command } => jobs::run(&config, command).await,
        Command::Shards { command } => shards::run(&config, command).await,
        Command::Snapshot { command: Some(snapshots::SnapshotCommand::List) } => snapshots::list(&config).await,
        Command::Snapshot { command: None } => snapshots::take_now(&config).await,
        Command::Restore(args) => snapshots::restore(&config, args).await,
        Command::Query(args) => query(&config, args).await,
    }
}

async fn topics_apply(config: &TallyConfig, file: Option<PathBuf>) -> anyhow::Result<()> {
    let decls = Declarations::load(file.as_deref().or(config.broker.declarations.as_deref()))?
        .with_log_retention(config.snapshots.log_retention_ms());
    let actions = topics::apply(&config.kafka, &decls).await?;
    let mut drift = false;
    for action in actions {
        match action {
            Action::Create { topic, partitions } => println!("created   {topic} ({partitions} partitions)"),
            Action::RaisePartitions { topic, from, to } => println!("raised    {topic} {from} → {to} partitions"),
            Action::Unchanged { topic } => println!("unchanged {topic}"),
            Action::Drift { topic, what } => {
                drift = true;
                println!("DRIFT     {topic}: {what}");
            }
        }
    }
    if drift {
        println!("some topics differ from their declarations; tally will not change them");
    }
    Ok(())
}

/// `tally config check`: the effective config, as TOML, secrets redacted.
fn config_check(path: Option<&std::path::Path>) -> anyhow::Result<()> {
    let config = TallyConfig::load(path).context("the config is not valid")?;
    // The queues it names load as a broker loads them.
    let declarations =
        Declarations::load(config.broker.declarations.as_deref()).context("the declarations are not valid")?;
    let shown = toml::to_string(&config.redacted()?).context("printing the config")?;
    let source = path.map_or_else(|| "defaults".to_string(), |p| p.display().to_string());
    let queues: Vec<&str> = declarations.queues.iter().map(|q| q.name.as_str()).collect();
    println!("# effective config: {source}, then TALLY__SECTION__KEY variables; secrets redacted");
    println!("# queues declared: {}", queues.join(", "));
    println!("# roles: {}\n{shown}", config.auth.describe_open_roles());
    Ok(())
}

/// Produces one record and prints where it went with its write token (the token
/// alone with `print_token`).
async fn produce(
    config: &TallyConfig,
    (topic, role): (&str, TokenTopic),
    key: &str,
    payload: &[u8],
    print_token: bool,
) -> anyhow::Result<()> {
    let (partition, offset) = produce_one(config, topic, key, payload).await?;
    let token = WriteToken { topic: role, partition: partition as u32, offset }.encode();
    match print_token {
        true => println!("{token}"),
        false => println!("produced to {topic} partition {partition} offset {offset}\ntoken {token}"),
    }
    Ok(())
}

/// Produces one record and waits for its acknowledgement, at most 30 s (tally's
/// producers never time out a record on their own: a command line has to). With
/// `telemetry.otlp_endpoint` set, the record starts a trace: its `traceparent`
/// header is the context of the send's span, exported before this returns.
pub(crate) async fn produce_one(
    config: &TallyConfig,
    topic: &str,
    key: &str,
    payload: &[u8],
) -> anyhow::Result<(i32, i64)> {
    otel::install(&config.telemetry, "tally")?;
    let span = otel::enabled().then(|| {
        Span::start(format!("send {topic}"), SpanKind::Producer, None)
            .attribute("messaging.system", "kafka")
            .attribute("messaging.operation.type", "send")
            .attribute("messaging.destination.name", topic)
    });
    let producer: FutureProducer = producer_config(&config.kafka)?.create()?;
    let mut record = FutureRecord::to(topic).key(key).payload(payload);
    if let Some(span) = &span {
        record = record.headers(otel::with_contexts(OwnedHeaders::new(), [&span.context]));
    }
    let wait = Duration::from_secs(30);
    let sent = match tokio::time::timeout(wait, producer.send(record, wait)).await {
        Ok(Ok(delivery)) => Ok((delivery.partition, delivery.offset)),
        Ok(Err((err, _))) => Err(anyhow::anyhow!("producing to {topic}: {err}")),
        Err(_) => Err(anyhow::anyhow!(
            "producing to {topic}: not acknowledged within {wait:?} (is Kafka at {} reachable?)",
            config.kafka.bootstrap_servers
        )),
    };
    if let Some(span) = span {
        let span = match &sent {
            Ok((partition, offset)) => span
                .attribute("messaging.destination.partition.id", partition.to_string())
                .attribute("messaging.kafka.offset", *offset),
            Err(err) => Span { error: Some(err.to_string()), ..span },
        };
        otel::record(span.end());
        tokio::task::spawn_blocking(|| otel::flush(Duration::from_secs(5))).await?;
    }
    sent
}

async fn query(config: &TallyConfig, args: QueryArgs) -> anyhow::Result<()> {
    let base = args.url.unwrap_or_else(|| format!("http://{}", config.query.listen));
    let entity = utf8_percent_encode(&args.entity, NON_ALPHANUMERIC);
    let metric = utf8_percent_encode(&args.metric, NON_ALPHANUMERIC);
    let mut url = if args.series {
        format!(
            "{base}/v1/counters/{entity}/{metric}/series?step={}&range={}&kind={}",
            args.step, args.range, args.kind
        )
    } else {
        format!("{base}/v1/counters/{entity}/{metric}?window={}&kind={}", args.window, args.kind)
    };
    if let Some(ms) = args.max_staleness_ms {
        url.push_str(&format!("&max_staleness_ms={ms}"));
    }
    if !args.after.is_empty() {
        url.push_str(&format!("&after={}", utf8_percent_encode(&args.after.join(","), NON_ALPHANUMERIC)));
    }
    if let Some(ms) = args.max_wait_ms {
        url.push_str(&format!("&max_wait_ms={ms}"));
    }
    for (dimension, value) in &args.segments {
        let (dimension, value) =
            (utf8_percent_encode(dimension, NON_ALPHANUMERIC), utf8_percent_encode(value, NON_ALPHANUMERIC));
        url.push_str(&format!("&segment.{dimension}={value}"));
    }
    if let Some(by) = &args.by {
        url.push_str(&format!("&by={}&limit=1000", utf8_percent_encode(by, NON_ALPHANUMERIC)));
    }
    get_and_print(config, &url).await
}

async fn graph(config: &TallyConfig, args: GraphArgs) -> anyhow::Result<()> {
    let base = args.url.unwrap_or_else(|| format!("http://{}", config.query.listen));
    let entity = utf8_percent_encode(&args.entity, NON_ALPHANUMERIC);
    let url = format!("{base}/v1/graph/{entity}?direction={}&limit={}", args.direction, args.limit);
    get_and_print(config, &url).await
}

/// GETs `url` from tally-query (with the configured token) and prints the JSON.
async fn get_and_print(config: &TallyConfig, url: &str) -> anyhow::Result<()> {
    let mut request = reqwest::Client::new().get(url);
    if let Some(token) = &config.auth.reader_token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.with_context(|| format!("GET {url}"))?;
    let status = response.status();
    // Printed as it came: counts past 2^64 would lose digits through a JSON tree.
    let body = response.text().await.context("reading the answer")?;
    println!("{body}");
    if !status.is_success() {
        bail!("{status}");
    }
    Ok(())
}

//! `tally jobs`: enqueue a job, show queue stats, list or requeue dead jobs.

use anyhow::{bail, Context};
use tally_core::jobs::api::QueueStats;
use tally_core::jobs::{DeadJobAction, Job};
use tally_core::position::token::{TokenTopic, WriteToken};
use tally_shared::config::TallyConfig;
use tally_shared::dead_jobs::DeadJobs;
use tally_shared::kafka::TopicNames;
use tally_shared::topics::Declarations;

#[derive(clap::Subcommand)]
pub enum JobsCommand {
    /// Enqueue one job: `tally jobs enqueue emails '{"to":"a@b"}'`.
    Enqueue {
        queue: String,
        /// The payload, any JSON.
        payload: String,
        /// Job id (default: a random one).
        #[arg(long)]
        id: Option<String>,
        /// Not before this time, ms since the epoch.
        #[arg(long)]
        run_at: Option<i64>,
        /// Ordering key (FIFO queues run one job of a key at a time).
        #[arg(long)]
        key: Option<String>,
        /// Priority level, 0 (the default, lowest) to the queue's `priority_levels - 1`.
        #[arg(long)]
        priority: Option<u8>,
        /// Concurrency key: on a queue with `[queue.limits]`, at most its limit of
        /// jobs of one key run at once.
        #[arg(long)]
        concurrency_key: Option<String>,
        /// Unique key: a job of a key held by an earlier one is refused (by this
        /// command when the brokers say it is held, else by the broker, to the
        /// dead-letter topic as a duplicate).
        #[arg(long)]
        unique_key: Option<String>,
        /// How long the unique key is held after the enqueue (default: the
        /// queue's `unique_for_ms`; 0: until the job finishes).
        #[arg(long, requires = "unique_key")]
        unique_for_ms: Option<i64>,
    },
    /// Depth, in flight, delayed, dead, rate and owners of every queue (or one).
    Stats {
        queue: Option<String>,
        /// A broker's worker API (default: from the config's broker.listen).
        #[arg(long)]
        broker: Option<String>,
    },
    /// Cancel a job: waiting, it never runs; running, its worker stops it on its next
    /// heartbeat. It is listed with the dead jobs as cancelled.
    Cancel {
        queue: String,
        id: String,
        /// A broker's worker API (default: from the config's broker.listen).
        #[arg(long)]
        broker: Option<String>,
    },
    /// The declared schedules of every queue (or one) and their next runs.
    Schedules {
        queue: Option<String>,
        /// How many next runs to list per schedule (1-100).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
        next: u16,
    },
    /// List the dead jobs of a queue not requeued or discarded yet; `--requeue`
    /// enqueues them again (and they leave the list).
    Dead {
        queue: String,
        #[arg(long)]
        requeue: bool,
    },
}

pub async fn run(config: &TallyConfig, command: JobsCommand) -> anyhow::Result<()> {
    let names = TopicNames::new(&config.kafka.topic_prefix);
    match command {
        JobsCommand::Enqueue {
            queue,
            payload,
            id,
            run_at,
            key,
            priority,
            concurrency_key,
            unique_key,
            unique_for_ms,
        } => {
            let payload: serde_json::Value = serde_json::from_str(&payload).context("the payload must be JSON")?;
            let id = id.unwrap_or_else(|| format!("job-{:016x}", rand::random::<u64>()));
            let mut job = serde_json::json!({"id": id, "payload": payload});
            if let Some(at) = run_at {
                job["run_at"] = at.into();
            }
            if let Some(key) = &key {
                job["key"] = key.clone().into();
            }
            if let Some(level) = priority {
                job["priority"] = level.into();
            }
            if let Some(key) = &concurrency_key {
                job["concurrency_key"] = key.clone().into();
            }
            if let Some(key) = &unique_key {
                job["unique_key"] = key.clone().into();
                if let Some(held_until) = unique_held(config, &queue, key).await {
                    let until = match held_until {
                        i64::MAX => "until the job holding it finishes".to_string(),
                        ms => format!("until {ms} ms since the epoch"),
                    };
                    bail!("refused: unique_key {key:?} is held {until} on queue {queue}; the job was not enqueued");
                }
            }
            if let Some(ms) = unique_for_ms {
                job["unique_for_ms"] = ms.into();
            }
            let bytes = serde_json::to_vec(&job)?;
            let parsed = Job::parse(&bytes).map_err(anyhow::Error::msg)?;
            // A queue declared here is checked as its brokers check it (one declared
            // elsewhere: they dead-letter what they refuse).
            let declarations = Declarations::load(config.broker.declarations.as_deref())?;
            if let Some(declared) = declarations.queue(&queue) {
                declared.policy().check(&parsed).map_err(|reason| anyhow::anyhow!("queue {queue}: {reason}"))?;
            }
            // Jobs of one key land together (a broker forwards one that does not).
            let record_key = unique_key.as_deref().or(concurrency_key.as_deref()).or(key.as_deref()).unwrap_or(&id);
            let (partition, offset) = crate::produce_one(config, &names.jobs(&queue), record_key, &bytes).await?;
            let token = WriteToken { topic: TokenTopic::Jobs(queue.clone()), partition: partition as u32, offset };
            println!("enqueued {id} on {queue}\ntoken {}", token.encode());
            Ok(())
        }
        JobsCommand::Stats { queue, broker } => {
            let base = broker.unwrap_or_else(|| format!("http://{}", config.broker.listen));
            let url = match &queue {
                Some(queue) => format!("{base}/v1/queues/{queue}"),
                None => format!("{base}/v1/queues"),
            };
            let mut request = reqwest::Client::new().get(&url);
            // Stats answer workers and operators alike.
            if let Some(token) = config.auth.operator_token.as_ref().or(config.auth.worker_token.as_ref()) {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.with_context(|| format!("GET {url}"))?;
            let status = response.status();
            let body: serde_json::Value = response.json().await?;
            if !status.is_success() {
                bail!("{status}: {body}");
            }
            let stats: Vec<QueueStats> = match queue {
                Some(_) => vec![serde_json::from_value(body)?],
                None => serde_json::from_value(body["queues"].clone())?,
            };
            println!(
                "{:<20} {:>8} {:>9} {:>8} {:>8} {:>6} {:>8} {:>10}  owners",
                "queue", "depth", "in flight", "delayed", "retrying", "dead", "rate/s", "oldest"
            );
            for s in &stats {
                let mut owners: Vec<&str> = s.partitions.iter().filter_map(|p| p.owner.as_deref()).collect();
                owners.sort();
                owners.dedup();
                let oldest = s.oldest_ready_age_ms.map_or("-".to_string(), |ms| format!("{:.1} s", ms as f64 / 1e3));
                println!(
                    "{:<20} {:>8} {:>9} {:>8} {:>8} {:>6} {:>8.1} {:>10}  {}",
                    &s.queue,
                    s.depth,
                    s.in_flight,
                    s.delayed,
                    s.retrying,
                    s.dead,
                    s.rate,
                    oldest,
                    owners.join(", ")
                );
            }
            for s in stats.iter().filter(|s| !s.limits.is_empty()) {
                println!("{}", limits_line(s));
            }
            println!("(counts are the answering broker's partitions; ask each owner for the rest)");
            Ok(())
        }
        JobsCommand::Cancel { queue, id, broker } => {
            let base = broker.unwrap_or_else(|| format!("http://{}", config.broker.listen));
            let url = format!("{base}/v1/queues/{queue}/cancel");
            let mut request = reqwest::Client::new().post(&url).json(&serde_json::json!({ "id": id }));
            if let Some(token) = &config.auth.operator_token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.with_context(|| format!("POST {url}"))?;
            let status = response.status();
            let body: serde_json::Value = response.json().await?;
            if !status.is_success() {
                bail!("{}", body["error"]["message"].as_str().map_or_else(|| body.to_string(), str::to_string));
            }
            match body["was"].as_str() {
                Some("running") => println!("cancelled {id} on {queue}: its worker stops it on its next heartbeat"),
                Some("waiting") => println!("cancelled {id} on {queue}: it will not run"),
                _ => println!("cancelled {id} on {queue}: not fetched yet, it will not run"),
            }
            Ok(())
        }
        JobsCommand::Schedules { queue, next } => {
            let declarations = Declarations::load(config.broker.declarations.as_deref())?;
            let now = tally_shared::kafka::now_ms();
            let mut listed = 0;
            for declared in declarations.queues.iter().filter(|q| queue.as_ref().is_none_or(|name| &q.name == name)) {
                for decl in &declared.schedules {
                    let schedule = tally_shared::schedules::Schedule::new(decl.clone()).map_err(anyhow::Error::msg)?;
                    let runs: Vec<String> = schedule
                        .ticks(now, i64::MAX, usize::from(next))
                        .into_iter()
                        .map(|at| schedule.describe(at))
                        .collect();
                    println!(
                        "{} {} {:?} ({}): next {}",
                        declared.name,
                        decl.name,
                        decl.cron,
                        decl.time_zone,
                        runs.join(", ")
                    );
                    listed += 1;
                }
            }
            if listed == 0 {
                println!("no schedules declared (add [[queue.schedule]] entries to the declarations file)");
            }
            Ok(())
        }
        JobsCommand::Dead { queue, requeue } => {
            let dead = std::sync::Arc::new(DeadJobs::new(&config.kafka, names.clone())?);
            let reader = dead.clone();
            let listed = queue.clone();
            let listing = tokio::task::spawn_blocking(move || reader.undecided(&listed)).await??;
            for job in &listing.jobs {
                println!(
                    "{}  attempts {}  partition {} offset {}  error: {}",
                    job.job.id, job.attempts, job.partition, job.offset, job.error
                );
            }
            println!("{} dead jobs on {queue} (not requeued or discarded yet)", listing.jobs.len());
            if listing.unreadable > 0 {
                eprintln!(
                    "{} records of {} are not dead jobs this build reads",
                    listing.unreadable,
                    names.dead_jobs(&queue)
                );
            }
            if requeue {
                let places: Vec<(i32, i64)> = listing.jobs.iter().map(|job| (job.partition, job.offset)).collect();
                let report = dead.decide_all(&queue, &places, DeadJobAction::Requeued).await?;
                println!("requeued {} jobs", report.decided);
                for (_, reason) in report.refused {
                    println!("not requeued: {reason}");
                }
                if let Some(failed) = report.failed {
                    anyhow::bail!("requeueing stopped {failed}");
                }
            }
            Ok(())
        }
    }
}

/// A limited queue's limits and its busiest keys, in one line.
fn limits_line(stats: &QueueStats) -> String {
    let limits = &stats.limits;
    let mut parts = Vec::new();
    if let Some(per_key) = limits.per_key {
        parts.push(format!("per key {per_key}"));
    }
    for o in &limits.overrides {
        parts.push(format!("{} {}", o.pattern, o.per_key));
    }
    if let Some(total) = limits.total {
        let in_flight: usize = stats.in_flight;
        parts.push(format!("total {in_flight}/{total}"));
    }
    let keys: Vec<String> = stats
        .top_keys
        .iter()
        .map(|k| format!("{} {}/{}", k.key, k.in_flight, k.limit.map_or("-".into(), |l| l.to_string())))
        .collect();
    let held = stats.partitions.iter().filter(|p| p.held_until.is_some()).count();
    let held = if held > 0 { format!("; {held} partitions held after a take-over") } else { String::new() };
    format!(
        "{} limits: {}; busiest keys: {}{held}",
        stats.queue,
        parts.join(", "),
        if keys.is_empty() { "none".into() } else { keys.join(", ") }
    )
}

/// Asks the broker serving `key`'s partition whether the unique key is held (until
/// when); none when it is free or no broker could say (the broker decides then).
async fn unique_held(config: &TallyConfig, queue: &str, key: &str) -> Option<i64> {
    let client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(5)).build().ok()?;
    let token = config.auth.operator_token.as_ref().or(config.auth.worker_token.as_ref());
    let get = |url: String| {
        let request = client.get(url);
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    };
    let stats: QueueStats =
        get(format!("http://{}/v1/queues/{queue}", config.broker.listen)).send().await.ok()?.json().await.ok()?;
    let partition = tally_core::jobs::limits::partition_of(key, stats.partitions.len() as i32);
    let owner = stats.partitions.iter().find(|p| p.partition == partition)?.owner.clone()?;
    let encoded = percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC);
    let answer: serde_json::Value =
        get(format!("http://{owner}/v1/queues/{queue}/unique/{encoded}")).send().await.ok()?.json().await.ok()?;
    answer["held_until"].as_i64()
}

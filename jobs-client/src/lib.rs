//! The jobs client (the worker library): dequeues a queue's jobs from the brokers that own its
//! partitions, runs a handler on each with bounded concurrency, extends the lease
//! while a job runs, and acks or nacks it.
//!
//! Any broker knows every partition's owner, so the worker starts from any broker
//! URL and refreshes the owners every few seconds (and at once when a broker stops
//! answering): when a partition moves, its jobs come from the new owner.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use tally_core::jobs::api::{
    AckRequest, DequeueRequest, DequeueResponse, DequeuedJob, ExtendRequest, NackRequest, QueueStats,
};
use tally_core::trace::{Span, SpanKind, SpanSink, TraceContext};

/// What can go wrong talking to the brokers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("worker: {0}")]
    Worker(String),
    /// The broker no longer holds the lease (expired, or its partition moved): the
    /// job may already run elsewhere.
    #[error("worker: the lease is no longer held")]
    LeaseLost,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Wall-clock ms since the epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// How a worker runs a queue.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Base URLs of any brokers (`http://host:port`).
    pub brokers: Vec<String>,
    pub queue: String,
    /// Jobs run at once.
    pub concurrency: usize,
    /// Lease asked for each job; the queue's default when `None`.
    pub lease_ms: Option<i64>,
    pub auth_token: Option<String>,
    /// How long a cancelled job's handler has to stop after it is told (its stop
    /// token is cancelled) before it is dropped — a command is sent SIGTERM, then
    /// killed. Never past the job's lease.
    pub stop_grace_ms: u64,
    /// Where the worker's spans go (`tally_shared::otel::sink()` in tally's
    /// worker): for a job handed out with a trace context, a span of its run (a
    /// child of the broker's) and of its ack or nack; the handler sees the run's
    /// context as the job's `traceparent`. `None`: no spans.
    pub spans: Option<SpanSink>,
}

/// What a handler says about a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ack,
    /// Failed: run again after `in_ms` (the queue's backoff when `None`).
    Retry {
        in_ms: Option<i64>,
        error: String,
    },
    /// Neither: stop extending the lease and let it expire (what a crashed worker
    /// does; the broker hands the job out again).
    Abandon,
}

/// Counts of what a worker did.
#[derive(Debug, Default)]
pub struct WorkerCounts {
    pub acked: AtomicU64,
    pub nacked: AtomicU64,
    /// Acks or nacks the broker refused (the lease had expired or moved), and jobs
    /// stopped because their lease could not be kept.
    pub lost_leases: AtomicU64,
}

/// Calls the broker API of one queue.
#[derive(Clone)]
pub struct BrokerClient {
    http: reqwest::Client,
    queue: String,
    auth_token: Option<String>,
}

fn http_error(err: reqwest::Error) -> Error {
    Error::Worker(err.to_string())
}

impl BrokerClient {
    pub fn new(queue: &str, auth_token: Option<String>) -> Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(40))
            .pool_max_idle_per_host(64)
            .build()
            .map_err(http_error)?;
        Ok(Self { http, queue: queue.to_string(), auth_token })
    }

    async fn post<T: Serialize, R: DeserializeOwned>(&self, base: &str, action: &str, body: &T) -> Result<R> {
        let url = format!("{base}/v1/queues/{}/{action}", self.queue);
        let mut request = self.http.post(&url).json(body);
        if let Some(token) = &self.auth_token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(http_error)?;
        let status = response.status();
        if status == reqwest::StatusCode::CONFLICT {
            return Err(Error::LeaseLost);
        }
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(Error::Worker(format!("{url}: {status} {text}")));
        }
        response.json().await.map_err(http_error)
    }

    /// The queue's stats from `base` (with every partition's owner).
    pub async fn stats(&self, base: &str) -> Result<QueueStats> {
        let url = format!("{base}/v1/queues/{}", self.queue);
        let mut request = self.http.get(&url);
        if let Some(token) = &self.auth_token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(http_error)?;
        if !response.status().is_success() {
            return Err(Error::Worker(format!("{url}: {}", response.status())));
        }
        response.json().await.map_err(http_error)
    }

    /// The base URLs of the brokers that own the queue's partitions, asking the
    /// seeds in turn.
    pub async fn owners(&self, seeds: &[String]) -> Vec<String> {
        for seed in seeds {
            if let Ok(stats) = self.stats(seed).await {
                let mut owners: Vec<String> = stats
                    .partitions
                    .iter()
                    .filter_map(|p| p.owner.as_ref())
                    .map(|addr| format!("http://{addr}"))
                    .collect();
                owners.sort();
                owners.dedup();
                return owners;
            }
        }
        Vec::new()
    }

    pub async fn dequeue(
        &self,
        base: &str,
        max: usize,
        lease_ms: Option<i64>,
        wait_ms: u64,
    ) -> Result<Vec<DequeuedJob>> {
        let response: DequeueResponse = self.post(base, "dequeue", &DequeueRequest { max, lease_ms, wait_ms }).await?;
        Ok(response.jobs)
    }

    /// Acks; `Ok(false)` when the broker no longer knew the lease.
    pub async fn ack(&self, base: &str, lease: &str) -> Result<bool> {
        let response: tally_core::jobs::api::AckResponse =
            self.post(base, "ack", &AckRequest { leases: vec![lease.to_string()] }).await?;
        Ok(response.unknown.is_empty())
    }

    pub async fn nack(&self, base: &str, lease: &str, retry_in_ms: Option<i64>, error: &str) -> Result<()> {
        let error = tally_core::jobs::api::error_text(error);
        let request = NackRequest { lease: lease.to_string(), retry_in_ms, error: Some(error.to_string()) };
        let _: serde_json::Value = self.post(base, "nack", &request).await?;
        Ok(())
    }

    /// Extends a lease; whether its job was cancelled (stop it, then nack).
    pub async fn extend(&self, base: &str, lease: &str, lease_ms: i64) -> Result<bool> {
        let answer: serde_json::Value =
            self.post(base, "extend", &ExtendRequest { lease: lease.to_string(), lease_ms }).await?;
        Ok(answer["cancelled"].as_bool().unwrap_or(false))
    }
}

/// Acks for one broker, sent together: whatever piles up while one ack request is
/// in flight goes out in the next (no timer, no added latency when idle).
#[derive(Clone)]
struct Acker {
    queue: tokio::sync::mpsc::UnboundedSender<(String, tokio::sync::oneshot::Sender<bool>)>,
}

impl Acker {
    fn spawn(client: BrokerClient, base: String) -> Self {
        let (queue, mut pending) =
            tokio::sync::mpsc::unbounded_channel::<(String, tokio::sync::oneshot::Sender<bool>)>();
        tokio::spawn(async move {
            while let Some(first) = pending.recv().await {
                let mut batch = vec![first];
                while batch.len() < tally_core::jobs::api::MAX_DEQUEUE {
                    match pending.try_recv() {
                        Ok(more) => batch.push(more),
                        Err(_) => break,
                    }
                }
                let leases: Vec<String> = batch.iter().map(|(lease, _)| lease.clone()).collect();
                let answer: Result<tally_core::jobs::api::AckResponse> =
                    client.post(&base, "ack", &AckRequest { leases }).await;
                let unknown: std::collections::HashSet<String> = match answer {
                    Ok(response) => response.unknown.into_iter().collect(),
                    Err(err) => {
                        tracing::debug!(broker = %base, error = %err, "ack failed; the jobs will run again");
                        batch.iter().map(|(lease, _)| lease.clone()).collect()
                    }
                };
                for (lease, reply) in batch {
                    if reply.send(!unknown.contains(&lease)).is_err() {
                        tracing::debug!(broker = %base, "an ack's answer is no longer waited for");
                    }
                }
            }
        });
        Self { queue }
    }

    /// Acks `lease`; false when the broker no longer knew it.
    async fn ack(&self, lease: String) -> bool {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.queue.send((lease, reply)).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

/// Runs `handler` on the queue's jobs until `shutdown`; jobs in hand finish first.
/// A cancelled job's handler is dropped when it is told ([`run_stoppable`] lets it
/// stop first).
pub async fn run<H, F>(options: WorkerOptions, handler: H, shutdown: CancellationToken) -> Result<Arc<WorkerCounts>>
where
    H: Fn(DequeuedJob) -> F + Send + Sync + 'static,
    F: Future<Output = Outcome> + Send + 'static,
{
    let options = WorkerOptions { stop_grace_ms: 0, ..options };
    run_stoppable(options, move |job, _stop| handler(job), shutdown).await
}

/// [`run`] with a handler that is given a stop token: it is cancelled when the
/// job is cancelled, and the handler has `stop_grace_ms` (within the lease) to
/// return before it is dropped.
pub async fn run_stoppable<H, F>(
    options: WorkerOptions,
    handler: H,
    shutdown: CancellationToken,
) -> Result<Arc<WorkerCounts>>
where
    H: Fn(DequeuedJob, CancellationToken) -> F + Send + Sync + 'static,
    F: Future<Output = Outcome> + Send + 'static,
{
    let client = BrokerClient::new(&options.queue, options.auth_token.clone())?;
    let handler = Arc::new(handler);
    let counts = Arc::new(WorkerCounts::default());
    let concurrency = options.concurrency.max(1);
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut owners: Vec<String> = Vec::new();
    let mut refreshed: Option<Instant> = None;
    let mut next = 0usize;
    let mut ackers: std::collections::HashMap<String, Acker> = std::collections::HashMap::new();
    while !shutdown.is_cancelled() {
        if owners.is_empty() || refreshed.is_none_or(|at| at.elapsed() > Duration::from_secs(2)) {
            owners = client.owners(&options.brokers).await;
            refreshed = Some(Instant::now());
            if owners.is_empty() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            }
        }
        let base = owners[next % owners.len()].clone();
        next += 1;
        // Wait for a free slot, then ask for as many jobs as there are free slots.
        let Ok(first) = slots.clone().acquire_owned().await else { break };
        let free = 1 + slots.available_permits();
        let wait_ms = if owners.len() > 1 { 100 } else { 1_000 };
        let jobs = tokio::select! {
            _ = shutdown.cancelled() => break,
            jobs = client.dequeue(&base, free, options.lease_ms, wait_ms) => jobs,
        };
        let jobs = match jobs {
            Ok(jobs) => jobs,
            Err(err) => {
                tracing::debug!(broker = %base, error = %err, "dequeue failed; refreshing the owners");
                refreshed = None;
                drop(first);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let mut first = Some(first);
        for job in jobs {
            let permit = match first.take() {
                Some(permit) => permit,
                None => match slots.clone().acquire_owned().await {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            let acker =
                ackers.entry(base.clone()).or_insert_with(|| Acker::spawn(client.clone(), base.clone())).clone();
            let (client, handler, counts, base) = (client.clone(), handler.clone(), counts.clone(), base.clone());
            let grace = Duration::from_millis(options.stop_grace_ms);
            let spans = options.spans.clone();
            tokio::spawn(async move {
                run_one(&client, &acker, (&base, grace, spans.as_ref()), job, handler.as_ref(), &counts).await;
                drop(permit);
            });
        }
    }
    // Let the jobs in hand finish.
    if let Err(err) = slots.acquire_many(concurrency as u32).await {
        // Only a closed semaphore fails, and nothing closes it.
        tracing::warn!(error = %err, "not waiting for the jobs in hand");
    }
    Ok(counts)
}

async fn run_one<H, F>(
    client: &BrokerClient,
    acker: &Acker,
    (base, grace, spans): (&str, Duration, Option<&SpanSink>),
    mut job: DequeuedJob,
    handler: &H,
    counts: &WorkerCounts,
) where
    H: Fn(DequeuedJob, CancellationToken) -> F,
    F: Future<Output = Outcome>,
{
    let run_span = spans.and_then(|_| run_span(&client.queue, &job));
    if let Some(span) = &run_span {
        job.traceparent = Some(span.context.header_value());
    }
    let (lease, id) = (job.lease.clone(), job.id.clone());
    let left_ms = job.lease_deadline - now_ms();
    let lease_ms = left_ms.max(1_000);
    // The job stops when its lease ends unless extended (a little early, for the
    // clocks): past it the broker hands the job out again, and on a limited queue
    // its slot is given to another.
    let margin = |ms: i64| Duration::from_millis((ms - ms / 20).max(0) as u64);
    let mut deadline = Instant::now() + margin(left_ms);
    let stop = CancellationToken::new();
    // The handler lives in this block: whatever ends it, it is gone (a command
    // killed) before the job is acked or nacked.
    let outcome = {
        let work = handler(job, stop.clone());
        tokio::pin!(work);
        // Extend at half the lease while the handler runs; after a failed extend, again
        // within a second.
        let mut every = Duration::from_millis(lease_ms as u64 / 2);
        loop {
            let next = (Instant::now() + every).min(deadline);
            tokio::select! {
                outcome = &mut work => break Some(outcome),
                _ = tokio::time::sleep_until(next.into()) => {}
            }
            if Instant::now() >= deadline {
                break None;
            }
            let sent = Instant::now();
            let extend = tokio::time::timeout_at(deadline.into(), client.extend(base, &lease, lease_ms));
            tokio::pin!(extend);
            let extended = tokio::select! {
                outcome = &mut work => break Some(outcome),
                extended = &mut extend => extended,
            };
            every = Duration::from_millis(lease_ms as u64 / 2);
            match extended {
                Ok(Ok(false)) => deadline = sent + margin(lease_ms),
                Ok(Ok(true)) => {
                    // Cancelled: told to stop, then dropped after the grace (within the lease).
                    deadline = sent + margin(lease_ms);
                    stop.cancel();
                    let until = (Instant::now() + grace).min(deadline);
                    tokio::time::timeout_at(until.into(), &mut work).await.ok();
                    break Some(Outcome::Retry { in_ms: None, error: "cancelled".into() });
                }
                Ok(Err(Error::LeaseLost)) => break None,
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "extending a lease; trying again");
                    every = every.min(Duration::from_secs(1));
                }
                Err(_) => break None,
            }
        }
    };
    let Some(outcome) = outcome else {
        // Dropping the handler stops it (a command is killed).
        counts.lost_leases.fetch_add(1, Ordering::Relaxed);
        tracing::info!(job = %id, "the job's lease could not be kept; the job was stopped and will run again");
        if let (Some(sink), Some(span)) = (spans, run_span) {
            sink.record(Span { error: Some("the lease could not be kept".into()), ..span }.end());
        }
        return;
    };
    let settle_span = run_span.as_ref().map(|run| settle_span(&client.queue, &run.context, &outcome));
    let settled = match &outcome {
        Outcome::Ack => {
            counts.acked.fetch_add(1, Ordering::Relaxed);
            Ok(acker.ack(lease.clone()).await)
        }
        Outcome::Retry { in_ms, error } => client.nack(base, &lease, *in_ms, error).await.map(|()| {
            counts.nacked.fetch_add(1, Ordering::Relaxed);
            true
        }),
        Outcome::Abandon => Ok(true),
    };
    let lost = !matches!(settled, Ok(true));
    if lost {
        counts.lost_leases.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(lease, "the broker no longer holds this lease; the job will run again");
    }
    if let (Some(sink), Some(run), Some(settle)) = (spans, run_span, settle_span) {
        let lease_lost = lost.then(|| "the broker no longer held the lease: the job will run again".to_string());
        sink.record(Span { error: lease_lost.clone(), ..settle }.end());
        let error = match &outcome {
            Outcome::Retry { error, .. } => Some(error.clone()),
            _ => lease_lost,
        };
        sink.record(Span { error, ..run }.end());
    }
}

/// The worker's span of a job's run, when the broker handed it out with a trace
/// context: a child of the broker's span.
fn run_span(queue: &str, job: &DequeuedJob) -> Option<Span> {
    let parent = TraceContext::parse(job.traceparent.as_deref()?.as_bytes())?;
    let span = Span::start(format!("process {queue}"), SpanKind::Consumer, Some(&parent))
        .attribute("messaging.system", "kafka")
        .attribute("messaging.operation.type", "process")
        .attribute("messaging.destination.partition.id", job.partition.to_string())
        .attribute("messaging.kafka.offset", job.offset)
        .attribute("messaging.message.id", job.id.as_str())
        .attribute("tally.queue", queue)
        .attribute("tally.job.attempt", i64::from(job.attempt));
    Some(span)
}

/// The span of telling the broker how a run went: a child of the run's.
fn settle_span(queue: &str, run: &TraceContext, outcome: &Outcome) -> Span {
    let action = match outcome {
        Outcome::Ack => "ack",
        Outcome::Retry { .. } => "nack",
        Outcome::Abandon => "abandon",
    };
    Span::start(format!("{action} {queue}"), SpanKind::Client, Some(run))
        .attribute("messaging.system", "kafka")
        .attribute("messaging.operation.type", "settle")
        .attribute("messaging.operation.name", action)
        .attribute("tally.queue", queue)
}

//! The broker's queues and the partitions it serves: dequeue, ack, nack, extend,
//! lease expiry and dead jobs, over the pure [`PartitionQueue`] of each partition.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_core::jobs::api::{DequeuedJob, KeyInFlight, PartitionInfo, QueueStats, TOP_KEYS};
use tally_core::jobs::limits::share;
use tally_core::jobs::partition::{Cancelled, Extended, Failure, Handout, LeaseError, PartitionQueue, CANCELLED};
use tally_core::jobs::DeadJob;
use tally_core::trace::{Span, SpanKind};
use tally_shared::kafka::{now_ms, TopicNames};
use tally_shared::lock::{lock, read, write};
use tally_shared::topics::QueueDecl;
use tokio::sync::Notify;

use crate::lease::LeaseSigner;
use crate::metrics::Metrics;

/// What each lock guards, as [`tally_shared::lock`] names it.
const DECL: &str = "a queue's settings";
pub const PARTITIONS: &str = "a queue's partitions";
pub const BUFFER: &str = "a partition's buffer";
const LIMITER: &str = "a queue's rate limiter";
const RATE_WINDOW: &str = "a queue's rate window";
pub const LAG: &str = "a queue's lag";
pub const OWNERS: &str = "a queue's partition owners";
const QUEUES: &str = "the broker's queues";
const CANCELS: &str = "the cancelled jobs";

/// One queue on this broker.
pub struct QueueRuntime {
    pub name: String,
    /// Its settings; replaced when a newer declaration arrives
    /// ([`Broker::declare`]).
    decl: RwLock<QueueDecl>,
    pub topic: String,
    pub dead_topic: String,
    /// The partitions this broker serves now; a revoked one is removed at once.
    pub partitions: Mutex<BTreeMap<i32, Arc<Mutex<PartitionQueue>>>>,
    /// Woken when jobs may have become available.
    pub changed: Notify,
    limiter: Mutex<Option<Arc<DefaultDirectRateLimiter>>>,
    cursor: AtomicUsize,
    pub dead: AtomicU64,
    /// Of the dead, those cancelled.
    pub cancelled: AtomicU64,
    /// Jobs replaced by a newer one of their unique key.
    pub replaced: AtomicU64,
    /// Jobs handed out, for the rate in the stats.
    handed: AtomicU64,
    rate_window: Mutex<(i64, u64, f64)>,
    /// Records not yet fetched, per partition (from the fetcher).
    pub lag: Mutex<HashMap<i32, i64>>,
    /// The end of each served partition's topic (its high watermark) when the lag
    /// was last measured.
    pub ends: Mutex<HashMap<i32, i64>>,
    /// Owner address of every partition, from the membership.
    pub owners: Mutex<BTreeMap<i32, String>>,
}

impl QueueRuntime {
    pub fn new(decl: QueueDecl, topic: String, dead_topic: String) -> Self {
        Self {
            name: decl.name.clone(),
            decl: RwLock::new(decl),
            topic,
            dead_topic,
            partitions: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
            limiter: Mutex::new(None),
            cursor: AtomicUsize::new(0),
            dead: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
            handed: AtomicU64::new(0),
            rate_window: Mutex::new((now_ms(), 0, 0.0)),
            lag: Mutex::new(HashMap::new()),
            ends: Mutex::new(HashMap::new()),
            owners: Mutex::new(BTreeMap::new()),
        }
    }

    /// The queue's current settings.
    pub fn decl(&self) -> RwLockReadGuard<'_, QueueDecl> {
        read(&self.decl, DECL)
    }

    /// This broker's share of the queue's rate limit: in proportion to the
    /// partitions it owns, exactly (a fractional rate, never rounded up), so the
    /// shares of all brokers add up to the limit.
    pub fn set_rate_share(&self, owned: usize) {
        let decl = self.decl().clone();
        let limiter = decl.rate_limit_per_sec.and_then(|rate| {
            if owned == 0 {
                return None;
            }
            let share = rate_share(rate, owned, decl.partitions);
            let period = Duration::from_secs_f64(1.0 / share);
            // A tenth of a second of burst: the limit holds over any second.
            let burst = NonZeroU32::new(((share / 10.0) as u32).max(1))?;
            Some(Arc::new(RateLimiter::direct(Quota::with_period(period)?.allow_burst(burst))))
        });
        *lock(&self.limiter, LIMITER) = limiter;
    }

    pub(crate) fn served(&self) -> Vec<(i32, Arc<Mutex<PartitionQueue>>)> {
        lock(&self.partitions, PARTITIONS).iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    /// The buffer of `partition` when this broker serves it.
    pub fn partition(&self, partition: i32) -> Option<Arc<Mutex<PartitionQueue>>> {
        lock(&self.partitions, PARTITIONS).get(&partition).cloned()
    }

    /// Partition `partition`'s share of the queue's `limits.total` (none: no total).
    pub fn slots(&self, partition: i32) -> Option<usize> {
        let decl = self.decl();
        let total = decl.limits.total?;
        let slots = share(total, decl.partitions, partition);
        if slots == 0 {
            tracing::error!(queue = %self.name, partition, total, partitions = decl.partitions,
                "the queue's limits.total is below its partitions: this partition runs nothing; raise the total");
        }
        Some(slots)
    }

    /// Whether its jobs need notifying waiters when one finishes (a FIFO key or a
    /// limit may let another out).
    fn gated(&self) -> bool {
        let decl = self.decl();
        decl.fifo || !decl.limits.is_empty()
    }
}

/// A queue's schedules as the stats show them, with their next runs.
fn schedule_infos(
    schedules: &[tally_shared::schedules::ScheduleDecl],
    now: i64,
) -> Vec<tally_core::jobs::api::ScheduleInfo> {
    schedules
        .iter()
        .map(|decl| tally_core::jobs::api::ScheduleInfo {
            name: decl.name.clone(),
            cron: decl.cron.clone(),
            time_zone: decl.time_zone.clone(),
            missed: match decl.missed {
                tally_shared::schedules::Missed::Once => "once".into(),
                tally_shared::schedules::Missed::Skip => "skip".into(),
            },
            next_at: tally_shared::schedules::Schedule::new(decl.clone()).ok().and_then(|s| s.next_after(now)),
        })
        .collect()
}

/// A broker's share of a queue's rate limit, in dequeues per second: the limit in
/// proportion to the partitions it owns. Not rounded, so the shares of brokers that
/// own every partition between them add up to the limit exactly.
pub fn rate_share(rate: u32, owned: usize, partitions: i32) -> f64 {
    f64::from(rate) * owned as f64 / f64::from(partitions.max(1))
}

pub struct Broker {
    pub instance: String,
    /// Issues and checks the lease tokens workers hold.
    leases: LeaseSigner,
    /// The queues served, by name: those of the declarations file at start, and
    /// every queue declared since on the declarations topic.
    queues: RwLock<BTreeMap<String, Arc<QueueRuntime>>>,
    pub metrics: Metrics,
    pub dead_producer: FutureProducer,
    /// The most bytes of one record this broker writes (dead jobs, dead letters).
    pub record_budget: usize,
    /// Tenures handed out so far: each partition taken gets the next one, so its
    /// lease numbers never repeat those of an earlier tenure in this process.
    pub tenures: AtomicU32,
    /// The ids of the cancelled jobs of each queue ([`crate::cancels`]), each with
    /// what it was doing when cancelled here (none: not held here).
    cancelled: RwLock<HashMap<String, HashMap<String, Option<Cancelled>>>>,
    /// The offset after the last cancellation read ([`crate::cancels`]).
    pub cancels_read: std::sync::atomic::AtomicI64,
}

impl Broker {
    pub fn new(
        instance: String,
        metrics: Metrics,
        dead_producer: FutureProducer,
        record_budget: usize,
    ) -> crate::Result<Self> {
        Ok(Self {
            leases: LeaseSigner::new(instance.clone())?,
            instance,
            queues: RwLock::new(BTreeMap::new()),
            metrics,
            dead_producer,
            record_budget,
            tenures: AtomicU32::new(0),
            cancelled: RwLock::new(HashMap::new()),
            cancels_read: std::sync::atomic::AtomicI64::new(0),
        })
    }

    /// Serves a queue, or takes newer settings of one served: the rate limit and
    /// partition count apply at once, buffer settings to partitions taken from now.
    pub fn declare(&self, decl: QueueDecl, names: &TopicNames) {
        let mut queues = write(&self.queues, QUEUES);
        match queues.get(&decl.name) {
            Some(queue) => {
                if *queue.decl() == decl {
                    return;
                }
                tracing::info!(queue = %decl.name, "queue settings changed");
                let policy = decl.policy();
                *write(&queue.decl, DECL) = decl;
                // Partitions held now take the new buffer settings at once.
                for (partition, buffer) in queue.served() {
                    let slots = queue.slots(partition);
                    let mut buffer = lock(&buffer, BUFFER);
                    buffer.set_policy(policy.clone());
                    buffer.set_slots(slots);
                }
                let owned = lock(&queue.partitions, PARTITIONS).len();
                queue.set_rate_share(owned);
            }
            None => {
                tracing::info!(queue = %decl.name, "serving a newly declared queue");
                let runtime = QueueRuntime::new(decl.clone(), names.jobs(&decl.name), names.dead_jobs(&decl.name));
                queues.insert(decl.name, Arc::new(runtime));
            }
        }
    }

    /// Every queue served.
    pub fn queues(&self) -> Vec<Arc<QueueRuntime>> {
        read(&self.queues, QUEUES).values().cloned().collect()
    }

    /// The tenure of a partition taken now.
    pub fn next_tenure(&self) -> u32 {
        self.tenures.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn queue(&self, name: &str) -> Option<Arc<QueueRuntime>> {
        read(&self.queues, QUEUES).get(name).cloned()
    }

    /// Hands out up to `max` ready jobs of `queue` from the partitions served here,
    /// within the rate limit.
    pub fn dequeue(&self, queue: &QueueRuntime, max: usize, lease_ms: i64, now: i64) -> Vec<DequeuedJob> {
        let limiter = lock(&queue.limiter, LIMITER).clone();
        let mut allowed = max;
        if let Some(limiter) = &limiter {
            allowed = (0..max).take_while(|_| limiter.check().is_ok()).count();
        }
        let served = queue.served();
        let mut jobs = Vec::new();
        if served.is_empty() || allowed == 0 {
            return jobs;
        }
        let start = queue.cursor.fetch_add(1, Ordering::Relaxed);
        for i in 0..served.len() {
            if jobs.len() >= allowed {
                break;
            }
            let (partition, buffer) = &served[(start + i) % served.len()];
            let mut buffer = lock(buffer, BUFFER);
            for handout in buffer.dequeue(allowed - jobs.len(), now, lease_ms) {
                let traceparent = handout_span(queue, *partition, &handout);
                jobs.push(DequeuedJob {
                    id: handout.job.id,
                    payload: handout.job.payload,
                    attempt: handout.attempt,
                    lease: self.leases.issue(*partition, handout.lease),
                    key: handout.job.key,
                    priority: handout.job.priority,
                    concurrency_key: handout.ckey,
                    partition: *partition,
                    offset: handout.offset,
                    lease_deadline: handout.deadline,
                    traceparent,
                });
            }
        }
        queue.handed.fetch_add(jobs.len() as u64, Ordering::Relaxed);
        self.metrics.dequeued.with_label_values(&[&queue.name]).inc_by(jobs.len() as u64);
        jobs
    }

    /// Acks leases; returns the unknown ones.
    pub fn ack(&self, queue: &QueueRuntime, leases: &[String]) -> Vec<String> {
        let mut unknown = Vec::new();
        let mut acked = 0u64;
        for token in leases {
            let done = self
                .leases
                .check(token)
                .and_then(|(partition, lease)| Some((queue.partition(partition)?, lease)))
                .and_then(|(buffer, lease)| lock(&buffer, BUFFER).ack(lease).ok());
            match done {
                Some(_) => acked += 1,
                None => unknown.push(token.clone()),
            }
        }
        self.metrics.acked.with_label_values(&[&queue.name]).inc_by(acked);
        if acked > 0 && queue.gated() {
            queue.changed.notify_waiters();
        }
        unknown
    }

    /// Nacks a lease: retried later, or dead after `max_attempts`.
    pub fn nack(
        self: &Arc<Self>,
        queue: &Arc<QueueRuntime>,
        token: &str,
        retry_in_ms: Option<i64>,
        error: &str,
    ) -> Result<(), LeaseError> {
        let (partition, lease) = self.leases.check(token).ok_or(LeaseError::Unknown)?;
        let buffer = queue.partition(partition).ok_or(LeaseError::Unknown)?;
        let failure = lock(&buffer, BUFFER).nack(lease, retry_in_ms, error, now_ms())?;
        self.metrics.nacked.with_label_values(&[&queue.name]).inc();
        self.handle_failure(queue, partition, failure);
        Ok(())
    }

    /// Remembers that job `id` of `queue` is cancelled, and cancels it in the
    /// partitions served here: what it was doing here when this broker cancelled it
    /// (none: not held here). A cancellation is both read from its topic and asked
    /// of the owners by the broker that wrote it, in either order: whichever comes
    /// second reports what the first found, so the answer never calls a job it just
    /// cancelled unknown.
    pub fn cancel_held(&self, queue: &str, id: &str) -> Option<Cancelled> {
        // Remembered first: a copy fetched meanwhile is dropped as cancelled.
        write(&self.cancelled, CANCELS).entry(queue.to_string()).or_default().entry(id.to_string()).or_insert(None);
        // Every partition: copies of one id may sit in several.
        let found = self.queue(queue).and_then(|runtime| {
            runtime.served().into_iter().filter_map(|(_, buffer)| lock(&buffer, BUFFER).cancel(id)).max()
        });
        if found.is_some() {
            tracing::info!(queue, job = id, state = ?found, "job cancelled");
        }
        let mut cancelled = write(&self.cancelled, CANCELS);
        let seen = cancelled.entry(queue.to_string()).or_default().entry(id.to_string()).or_insert(None);
        *seen = (*seen).max(found);
        *seen
    }

    /// Forgets the cancellation of job `id` of `queue` (it was requeued).
    pub fn uncancel(&self, queue: &str, id: &str) {
        if let Some(ids) = write(&self.cancelled, CANCELS).get_mut(queue) {
            ids.remove(id);
        }
    }

    /// Whether job `id` of `queue` was cancelled.
    pub fn is_cancelled(&self, queue: &str, id: &str) -> bool {
        read(&self.cancelled, CANCELS).get(queue).is_some_and(|ids| ids.contains_key(id))
    }

    /// Until when `key` is held in `partition` of `queue` (the inner none: free),
    /// when this broker serves the partition.
    pub fn unique_held_until(&self, queue: &QueueRuntime, partition: i32, key: &str) -> Option<Option<i64>> {
        let buffer = queue.partition(partition)?;
        let held = lock(&buffer, BUFFER).unique_held_until(key, now_ms());
        Some(held)
    }

    /// The records of `queue` not fetched yet by this broker as of now (the reported
    /// lag can be a second old, or not reported yet): [`unfetched`] of each served
    /// partition, and those partitions. A partition whose end cannot be read by
    /// `deadline` counts as one record unfetched. Blocking.
    pub fn unfetched_now(&self, queue: &QueueRuntime, deadline: std::time::Instant) -> (i64, Vec<i32>) {
        let client = rdkafka::producer::Producer::client(&self.dead_producer);
        let served = queue.served();
        let partitions = served.iter().map(|(partition, _)| *partition).collect();
        let unfetched = served
            .into_iter()
            .map(|(partition, buffer)| {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                match unfetched(client, &queue.topic, (partition, &buffer), left) {
                    Ok((_, unfetched)) => unfetched,
                    Err(err) => {
                        tracing::warn!(queue = %queue.name, partition, error = %err, "reading a partition's end");
                        1
                    }
                }
            })
            .sum();
        (unfetched, partitions)
    }

    /// Extends a lease; returns the new deadline, and whether its job was cancelled.
    pub fn extend(&self, queue: &QueueRuntime, token: &str, lease_ms: i64) -> Result<Extended, LeaseError> {
        let (partition, lease) = self.leases.check(token).ok_or(LeaseError::Unknown)?;
        let buffer = queue.partition(partition).ok_or(LeaseError::Unknown)?;
        let mut buffer = lock(&buffer, BUFFER);
        buffer.extend(lease, lease_ms, now_ms())
    }

    /// Fails the expired leases of every served partition, and sends the jobs
    /// dropped at their key's limit to the dead topic.
    pub fn expire_leases(self: &Arc<Self>) {
        let now = now_ms();
        for queue in self.queues() {
            for (partition, buffer) in queue.served() {
                let (failures, dropped) = {
                    let mut buffer = lock(&buffer, BUFFER);
                    (buffer.expire(now), buffer.take_ended())
                };
                for failure in dropped {
                    if !matches!(&failure, Failure::Dead { error, .. } if error == CANCELLED) {
                        self.metrics.dropped.with_label_values(&[&queue.name]).inc();
                    }
                    self.handle_failure(&queue, partition, failure);
                }
                for failure in failures {
                    if let Failure::Retry { offset, .. } = &failure {
                        tracing::info!(queue = %queue.name, partition, offset, "lease expired; the job will run again");
                    }
                    self.metrics.expired.with_label_values(&[&queue.name]).inc();
                    self.handle_failure(&queue, partition, failure);
                }
            }
        }
    }

    fn handle_failure(self: &Arc<Self>, queue: &Arc<QueueRuntime>, partition: i32, failure: Failure) {
        match failure {
            Failure::Retry { .. } => queue.changed.notify_waiters(),
            Failure::Dead { offset, attempts, error, job } => {
                tracing::warn!(queue = %queue.name, partition, offset, attempts, %error, job = %job.id, "job is dead");
                let dead = DeadJob {
                    v: tally_core::format::JSON_V1,
                    queue: queue.name.clone(),
                    partition,
                    offset,
                    attempts,
                    error,
                    job: *job,
                    truncated: Default::default(),
                };
                let broker = self.clone();
                let queue = queue.clone();
                tokio::spawn(async move { broker.publish_dead(&queue, partition, dead).await });
            }
        }
    }

    /// Writes a dead job to the dead topic (retrying until it is acknowledged), then
    /// finishes it so the watermark can pass it.
    async fn publish_dead(&self, queue: &QueueRuntime, partition: i32, dead: DeadJob) {
        let (id, offset, cancelled) = (dead.job.id.clone(), dead.offset, dead.error == CANCELLED);
        let payload = match dead.encode(self.record_budget) {
            Ok(payload) => payload,
            Err(err) => {
                // Fail closed: the job stays unfinished (the watermark never passes it).
                tracing::error!(error = %err, queue = %queue.name, partition, offset, "cannot encode a dead job");
                return;
            }
        };
        loop {
            let record = FutureRecord::to(&queue.dead_topic).key(&id).payload(&payload);
            match self.dead_producer.send(record, Duration::from_secs(10)).await {
                Ok(_) => break,
                Err((err, _)) => {
                    tracing::warn!(error = %err, queue = %queue.name, "writing a dead job; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        if let Some(buffer) = queue.partition(partition) {
            lock(&buffer, BUFFER).finish_dead(offset);
        }
        queue.dead.fetch_add(1, Ordering::Relaxed);
        self.metrics.dead.with_label_values(&[&queue.name]).inc();
        if cancelled {
            queue.cancelled.fetch_add(1, Ordering::Relaxed);
            self.metrics.cancelled.with_label_values(&[&queue.name]).inc();
        }
    }

    /// The jobs in flight of the partitions this broker serves: the first `limit`
    /// by partition and offset, and how many there are.
    pub fn running(&self, queue: &QueueRuntime, limit: usize) -> tally_core::jobs::api::RunningJobs {
        let mut running = Vec::new();
        let mut total = 0;
        for (partition, buffer) in queue.served() {
            let jobs = lock(&buffer, BUFFER).running(partition);
            total += jobs.len();
            running.extend(jobs.into_iter().take(limit.saturating_sub(running.len())));
        }
        tally_core::jobs::api::RunningJobs { running, total }
    }

    /// The stats of a queue as this broker sees it.
    pub fn stats(&self, queue: &QueueRuntime) -> QueueStats {
        let now = now_ms();
        let served: BTreeMap<i32, _> = queue.served().into_iter().collect();
        let lag = lock(&queue.lag, LAG).clone();
        let owners = lock(&queue.owners, OWNERS).clone();
        let decl = queue.decl().clone();
        let mut stats = QueueStats {
            queue: queue.name.clone(),
            dead: queue.dead.load(Ordering::Relaxed),
            cancelled: queue.cancelled.load(Ordering::Relaxed),
            replaced: queue.replaced.load(Ordering::Relaxed),
            rate: self.rate(queue, now),
            rate_limit_per_sec: decl.rate_limit_per_sec,
            fifo: decl.fifo,
            limits: decl.limits.clone(),
            schedules: schedule_infos(&decl.schedules, now),
            ..Default::default()
        };
        let mut keys: Vec<KeyInFlight> = Vec::new();
        for partition in 0..decl.partitions {
            let mut info = PartitionInfo { partition, owner: owners.get(&partition).cloned(), ..Default::default() };
            if let Some(buffer) = served.get(&partition) {
                let (s, slots, held_until) = {
                    let buffer = lock(buffer, BUFFER);
                    let limit = |key: &str| decl.limits.limit_of(key);
                    keys.extend(buffer.keys_in_flight().map(|(key, in_flight)| KeyInFlight {
                        key: key.to_string(),
                        in_flight,
                        limit: limit(key),
                    }));
                    (buffer.stats(now), buffer.slots(), buffer.held_until(now))
                };
                let oldest_ready_age_ms = s.oldest_ready_since.map(|since| (now - since).max(0));
                info = PartitionInfo {
                    ready: s.ready,
                    delayed: s.delayed,
                    retrying: s.retrying,
                    in_flight: s.in_flight,
                    oldest_ready_age_ms,
                    slots,
                    held_until,
                    ..info
                };
                info.owned_here = true;
                info.lag = lag.get(&partition).copied().unwrap_or(0);
                stats.depth += (info.ready + info.delayed) as i64 + info.lag;
                stats.in_flight += info.in_flight;
                stats.delayed += info.delayed;
                stats.retrying += info.retrying;
                stats.oldest_ready_age_ms = stats.oldest_ready_age_ms.max(oldest_ready_age_ms);
            }
            stats.partitions.push(info);
        }
        keys.sort_unstable_by(|a, b| b.in_flight.cmp(&a.in_flight).then_with(|| a.key.cmp(&b.key)));
        keys.truncate(TOP_KEYS);
        stats.top_keys = keys;
        stats
    }

    /// Jobs handed out per second since the last call (at least a second apart).
    fn rate(&self, queue: &QueueRuntime, now: i64) -> f64 {
        let handed = queue.handed.load(Ordering::Relaxed);
        let mut window = lock(&queue.rate_window, RATE_WINDOW);
        let (since, count, rate) = *window;
        if now - since >= 1_000 {
            let fresh = (handed - count) as f64 * 1_000.0 / (now - since) as f64;
            *window = (now, handed, fresh);
            return fresh;
        }
        rate
    }
}

/// The trace context a handout passes on to its worker, when its job's record
/// carried one: with spans exported, the broker's span of the handout (from the
/// job's enqueue to its handout, a child of the producer's context); otherwise the
/// producer's context as it came.
fn handout_span(queue: &QueueRuntime, partition: i32, handout: &Handout) -> Option<String> {
    let trace = handout.job.trace?;
    if !tally_shared::otel::enabled() {
        return Some(trace.parent.header_value());
    }
    let mut span = Span::start(format!("deliver {}", queue.topic), SpanKind::Consumer, Some(&trace.parent))
        .attribute("messaging.system", "kafka")
        .attribute("messaging.operation.type", "receive")
        .attribute("messaging.operation.name", "deliver")
        .attribute("messaging.destination.name", queue.topic.as_str())
        .attribute("messaging.destination.partition.id", partition.to_string())
        .attribute("messaging.kafka.offset", handout.offset)
        .attribute("messaging.message.id", handout.job.id.as_str())
        .attribute("tally.queue", queue.name.as_str())
        .attribute("tally.job.attempt", i64::from(handout.attempt));
    span.start_unix_nanos = u64::try_from(trace.enqueued_at_ms).unwrap_or(0).saturating_mul(1_000_000);
    let span = span.end();
    let context = span.context.header_value();
    tally_shared::otel::record(span);
    Some(context)
}

/// A served partition's log end and how many records below it its buffer has not
/// fetched: the end is read first, then the buffer's position, so a slow round trip
/// never counts records fetched meanwhile as unfetched.
pub(crate) fn unfetched<C: rdkafka::ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &str,
    (partition, buffer): (i32, &Mutex<PartitionQueue>),
    timeout: Duration,
) -> rdkafka::error::KafkaResult<(i64, i64)> {
    let (_, end) = client.fetch_watermarks(topic, partition, timeout)?;
    Ok((end, (end - lock(buffer, BUFFER).fetched_until()).max(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cancellation reaches an owner twice — read from its topic, and asked by the
    /// broker that wrote it — in either order: both report what the first found.
    #[test]
    fn a_cancel_asked_after_the_topic_applied_it_reports_what_it_found() {
        let producer: FutureProducer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", "127.0.0.1:9").create().unwrap();
        let broker = Broker::new("test".into(), Metrics::new(&prometheus::Registry::new()), producer, 1 << 20).unwrap();
        let decl = tally_shared::topics::Declarations::load(None).unwrap().queue("default").unwrap().clone();
        broker.declare(decl, &TopicNames::new("t."));
        let queue = broker.queue("default").unwrap();
        let mut buffer = PartitionQueue::new(queue.decl().policy(), 0, 0);
        for (offset, id) in ["waits", "runs"].into_iter().enumerate() {
            let job = tally_core::jobs::Job::parse(format!(r#"{{"id":"{id}","payload":{{}}}}"#).as_bytes()).unwrap();
            buffer.push(offset as i64, job, now_ms());
        }
        lock(&queue.partitions, PARTITIONS).insert(0, Arc::new(Mutex::new(buffer)));
        let handed = broker.dequeue(&queue, 1, 60_000, now_ms());
        let running = handed.first().map(|job| job.id.clone()).unwrap();
        let waiting = ["waits", "runs"].into_iter().find(|id| *id != running).unwrap();

        let twice = |id: &str| (broker.cancel_held("default", id), broker.cancel_held("default", id));
        let answers = [twice(waiting), twice(&running), twice("unknown")];
        let (w, r) = (Some(Cancelled::Waiting), Some(Cancelled::Running));
        assert_eq!(answers, [(w, w), (r, r), (None, None)]);
        assert!(broker.is_cancelled("default", "unknown"), "kept, should it be enqueued later");
        broker.uncancel("default", waiting);
        assert!(!broker.is_cancelled("default", waiting));
    }

    #[test]
    fn rate_shares_add_up_to_the_limit() {
        for (rate, owned) in [(10u32, vec![2usize, 1, 1]), (2, vec![1, 1, 1, 1]), (100, vec![3, 0, 1]), (7, vec![4])] {
            let partitions = owned.iter().sum::<usize>() as i32;
            let total: f64 = owned.iter().map(|&n| rate_share(rate, n, partitions)).sum();
            assert!((total - f64::from(rate)).abs() < 1e-9, "{rate} over {owned:?}: {total}");
        }
        assert_eq!(rate_share(2, 1, 4), 0.5, "less than one a second is still a rate");
    }

    /// Without span export (none is set up in unit tests) a job's trace context goes
    /// on to its worker as the producer wrote it; a job without one passes none.
    #[test]
    fn a_handout_passes_its_jobs_trace_context_on_without_export() {
        let decl = tally_shared::topics::Declarations::load(None).unwrap().queue("default").unwrap().clone();
        let queue = QueueRuntime::new(decl, "t.jobs.default".into(), "t.jobs.default.dead".into());
        let job = tally_core::jobs::Job::parse(br#"{"id":"j1","payload":{}}"#).unwrap();
        let handout = |job| Handout { offset: 7, lease: 1, attempt: 1, deadline: 0, job, ckey: None };
        assert_eq!(handout_span(&queue, 0, &handout(job.clone())), None);
        let parent = tally_core::trace::TraceContext::root();
        let traced =
            tally_core::jobs::Job { trace: Some(tally_core::jobs::JobTrace { parent, enqueued_at_ms: 5 }), ..job };
        assert_eq!(handout_span(&queue, 0, &handout(traced)), Some(parent.header_value()));
    }
}

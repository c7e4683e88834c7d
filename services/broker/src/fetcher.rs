//! The fetcher thread: follows the membership to decide which queue partitions this
//! broker serves (a member is gone when its heartbeats stopped while this broker's
//! went on: [`Membership::live_as_seen_by`]), fetches them into their buffers
//! (pausing a partition whose buffer is full), and commits each partition's
//! watermark.
//!
//! A partition that moves away stops being served at once; one that moves here is
//! taken after a short settling delay (so its previous owner has let go) from the
//! committed offset — everything below it is finished, everything above runs again
//! if it was not (at-least-once).
//!
//! On a queue whose unique keys are held for a window, a partition taken is served
//! once the window's finished jobs are replayed (on a thread of their own,
//! [`crate::placement::Replays`]), so it refuses duplicates as its previous owner did.
//!
//! On a queue with concurrency limits a partition taken is held (hands out nothing)
//! until the leases its previous owner may have handed out have ended: for the
//! queue's `max_lease_ms` plus the membership timeout (a broker that lets a
//! partition go extends and hands out nothing more of it at once; one that died
//! is noticed within the timeout). A job of a limited key fetched in another
//! partition than its key's is forwarded there (written, then finished).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Message};
use tally_core::assignment::owner;
use tally_core::jobs::partition::PartitionQueue;
use tally_core::jobs::{Job, JobTrace};
use tally_core::wire::DeadLetter;
use tally_shared::config::TallyConfig;
use tally_shared::kafka::{client_config, now_ms, unstamped_producer_config, TopicNames};
use tally_shared::lock::lock;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::state::{unfetched, Broker, QueueRuntime, BUFFER, LAG, OWNERS, PARTITIONS};
use tally_shared::membership::Membership;

const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// What [`LetterContext::written`]'s lock guards ([`tally_shared::lock`]).
const WRITTEN: &str = "the dead letters written";

pub struct FetcherSetup {
    pub config: TallyConfig,
    pub broker: Arc<Broker>,
    pub membership: Arc<Membership>,
}

type Key = (String, i32);

pub fn run(setup: FetcherSetup, shutdown: CancellationToken) -> Result<()> {
    let FetcherSetup { config, broker, membership } = setup;
    let mut consumer_config = client_config(&config.kafka)?;
    consumer_config
        .set("group.id", &config.broker.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = consumer_config.create()?;
    let letters: ThreadedProducer<LetterContext> =
        unstamped_producer_config(&config.kafka)?.create_with_context(LetterContext::default())?;
    let dead_letter_topic = TopicNames::new(&config.kafka.topic_prefix).dead_letter();
    let cancels_topic = TopicNames::new(&config.kafka.topic_prefix).jobs_cancelled();
    let mut by_topic: HashMap<String, Arc<QueueRuntime>> = HashMap::new();
    let settle = Duration::from_millis(config.broker.heartbeat_ms * 2);
    let member_timeout_ms = config.broker.member_timeout_ms as i64;
    let reporter = spawn_reporter(&config, broker.clone(), shutdown.clone())?;

    let mut pending: HashMap<Key, Instant> = HashMap::new();
    let mut paused: HashSet<Key> = HashSet::new();
    let mut replays = crate::placement::Replays::default();
    let mut last_commit = Instant::now();
    let mut last_reconcile = Instant::now() - Duration::from_secs(1);
    while !shutdown.is_cancelled() {
        if last_reconcile.elapsed() >= Duration::from_millis(200) {
            last_reconcile = Instant::now();
            let live = membership.live_as_seen_by(&broker.instance, now_ms(), config.broker.member_timeout_ms);
            // Queues declared since the last round join here.
            by_topic = broker.queues().into_iter().map(|q| (q.topic.clone(), q)).collect();
            for queue in by_topic.values() {
                let mut desired = Vec::new();
                let mut owners = BTreeMap::new();
                let partitions = queue.decl().partitions;
                for partition in 0..partitions {
                    if let Some(member) = owner(&live, &queue.name, partition) {
                        owners.insert(partition, member.addr.clone());
                        if member.instance == broker.instance {
                            desired.push(partition);
                        }
                    }
                }
                *lock(&queue.owners, OWNERS) = owners;
                let mut taking = Taking {
                    pending: &mut pending,
                    paused: &mut paused,
                    settle,
                    member_timeout_ms,
                    kafka: &config.kafka,
                    replays: &mut replays,
                };
                reconcile(&consumer, &broker, queue, &desired, &mut taking)?;
            }
        }
        if let Some(polled) = consumer.poll(Duration::from_millis(20)) {
            match polled {
                Ok(message) => {
                    let Some(queue) = by_topic.get(message.topic()) else { continue };
                    let partition = message.partition();
                    let Some(buffer) = lock(&queue.partitions, PARTITIONS).get(&partition).cloned() else {
                        continue; // revoked meanwhile
                    };
                    let payload = message.payload().unwrap_or_default();
                    let now = now_ms();
                    let enqueued_at = message.timestamp().to_millis().filter(|ts| *ts >= 0).unwrap_or(now);
                    let (max_delay_ms, policy) = {
                        let decl = queue.decl();
                        (decl.max_delay_ms(), decl.policy())
                    };
                    let trace = tally_shared::otel::contexts_of(message.headers())
                        .first()
                        .map(|&parent| JobTrace { parent, enqueued_at_ms: enqueued_at });
                    let mut parsed = Job::parse(payload)
                        .map(|job| Job { trace, ..job })
                        .and_then(|job| check_delay(job, enqueued_at, max_delay_ms))
                        .and_then(|job| policy.check(&job).map(|()| job));
                    let partitions = queue.decl().partitions;
                    let home = match parsed
                        .as_ref()
                        .map(|job| crate::placement::home_partition(&policy.limits, job, partitions))
                    {
                        Ok(Ok(home)) => home,
                        Ok(Err(reason)) => {
                            parsed = Err(reason);
                            None
                        }
                        Err(_) => None,
                    };
                    // Only for a job it will hold: one it forwards is judged at home.
                    let cancelled = parsed.as_ref().is_ok_and(|job| {
                        let topic = &cancels_topic;
                        home.is_none_or(|home| home == partition)
                            && crate::cancels::is_cancelled_when_fetched(
                                &consumer,
                                &broker,
                                topic,
                                &queue.name,
                                &job.id,
                            )
                    });
                    let (full, rejected, refetched) = {
                        let mut buffer = lock(&buffer, BUFFER);
                        // A re-fetched offset was decided when first fetched.
                        let refetched = message.offset() < buffer.fetched_until();
                        let rejected = match parsed {
                            _ if refetched => None,
                            Ok(_) if home.is_some_and(|home| home != partition) => {
                                // Held until its copy is written in its key's partition.
                                buffer.reject(message.offset());
                                None
                            }
                            Ok(mut job) => match buffer.admit_unique(message.offset(), &mut job, enqueued_at) {
                                Ok(replaced) => {
                                    if let Some(offset) = replaced {
                                        tracing::debug!(queue = %queue.name, partition, offset, by = message.offset(), "job replaced");
                                        queue.replaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        broker.metrics.replaced.with_label_values(&[&queue.name]).inc();
                                    }
                                    let cancelled = cancelled.then(|| job.id.clone());
                                    buffer.push(message.offset(), job, now);
                                    if let Some(id) = cancelled {
                                        // Ends as cancelled, never handed out.
                                        buffer.cancel(&id);
                                    }
                                    None
                                }
                                Err(duplicate) => {
                                    buffer.reject(message.offset());
                                    Some(duplicate)
                                }
                            },
                            Err(reason) => {
                                // Held until the dead letter is acknowledged
                                // (`LetterContext`): the watermark never passes it before.
                                buffer.reject(message.offset());
                                Some(reason)
                            }
                        };
                        (!buffer.has_room(now), rejected.filter(|_| !refetched), refetched)
                    };
                    // Sent with no lock held: a full producer queue waits here, and
                    // delivery callbacks never wait for this thread.
                    let letter = Letter { queue: queue.name.clone(), partition, offset: message.offset() };
                    if let Some(reason) = rejected {
                        let budget = broker.record_budget;
                        dead_letter(&letters, &dead_letter_topic, &queue.topic, &message, &reason, letter, budget);
                    } else if let Some(home) = home.filter(|home| *home != partition && !refetched) {
                        forward(&letters, &queue.topic, home, &message, letter);
                    }
                    queue.changed.notify_waiters();
                    if full && paused.insert((queue.name.clone(), partition)) {
                        let mut tpl = TopicPartitionList::new();
                        tpl.add_partition(&queue.topic, partition);
                        consumer.pause(&tpl)?;
                    }
                }
                Err(err) => tracing::warn!(error = %err, "consumer error"),
            }
        }
        letters.context().finish_written(&broker);
        resume_drained(&consumer, &broker, &mut paused)?;
        if last_commit.elapsed() >= COMMIT_EVERY {
            last_commit = Instant::now();
            commit(&consumer, &broker, CommitMode::Async, false);
        }
    }
    commit(&consumer, &broker, CommitMode::Sync, true);
    if let Err(err) = letters.flush(Duration::from_secs(5)) {
        // Their records stay unfinished, the committed watermarks below them.
        tracing::warn!(error = %err, "dead letters not flushed at shutdown");
    }
    if reporter.join().is_err() {
        tracing::warn!("the broker's reporter thread panicked");
    }
    Ok(())
}

/// How the partitions this broker takes are taken.
struct Taking<'a> {
    pending: &'a mut HashMap<Key, Instant>,
    paused: &'a mut HashSet<Key>,
    settle: Duration,
    member_timeout_ms: i64,
    kafka: &'a tally_shared::config::KafkaConfig,
    replays: &'a mut crate::placement::Replays,
}

/// Serves what this broker should own, and stops serving what it should not.
fn reconcile(
    consumer: &BaseConsumer,
    broker: &Broker,
    queue: &Arc<QueueRuntime>,
    desired: &[i32],
    taking: &mut Taking<'_>,
) -> Result<()> {
    let served: Vec<i32> = lock(&queue.partitions, PARTITIONS).keys().copied().collect();
    let mut changed = false;
    for partition in served.iter().filter(|p| !desired.contains(p)) {
        let removed = lock(&queue.partitions, PARTITIONS).remove(partition);
        if let Some(buffer) = removed {
            let offset = {
                let mut buffer = lock(&buffer, BUFFER);
                buffer.retire();
                buffer.commit_offset()
            };
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&queue.topic, *partition, Offset::Offset(offset))?;
            if let Err(err) = consumer.commit(&tpl, CommitMode::Sync) {
                tracing::warn!(error = %err, "committing a released partition");
            }
            consumer.incremental_unassign(&tpl)?;
            taking.paused.remove(&(queue.name.clone(), *partition));
            tracing::info!(queue = %queue.name, partition, offset, "released partition");
            changed = true;
        }
    }
    let mut tpl = TopicPartitionList::new();
    for (partition, replayed) in taking.replays.finished(&queue.name, desired) {
        match replayed {
            Ok(replayed) => {
                tracing::info!(queue = %queue.name, partition, replayed = replayed.records,
                    "replayed the unique keys held before the committed offset");
                serve(queue, replayed.partition, replayed.start, replayed.buffer, taking, &mut tpl)?;
            }
            // Not served until its keys are known: taken again.
            Err(err) => tracing::error!(queue = %queue.name, partition, error = %err,
                "replaying the unique keys failed; the partition is taken again"),
        }
    }
    let policy = queue.decl().policy();
    let unique = policy.unique_for_ms > 0;
    let mut replay_room = taking.replays.room();
    let mut acquire = Vec::new();
    for &partition in desired.iter() {
        let taken = lock(&queue.partitions, PARTITIONS).contains_key(&partition);
        if taken || taking.replays.is_replaying(&queue.name, partition) {
            continue;
        }
        let key = (queue.name.clone(), partition);
        let since = *taking.pending.entry(key.clone()).or_insert_with(Instant::now);
        if since.elapsed() >= taking.settle && (!unique || replay_room > 0) {
            replay_room -= usize::from(unique);
            taking.pending.remove(&key);
            acquire.push(partition);
        }
    }
    if !acquire.is_empty() {
        // One round trip for all the committed offsets.
        let starts = committed_offsets(consumer, &queue.topic, &acquire)?;
        for (partition, start) in acquire.into_iter().zip(starts) {
            let buffer = PartitionQueue::new(policy.clone(), start, broker.next_tenure());
            match unique {
                true => taking.replays.start(taking.kafka, queue.clone(), partition, start, buffer)?,
                false => serve(queue, partition, start, buffer, taking, &mut tpl)?,
            }
        }
    }
    if tpl.count() > 0 {
        consumer.incremental_assign(&tpl)?;
        changed = true;
    }
    taking.pending.retain(|(name, partition), _| name != &queue.name || desired.contains(partition));
    if changed {
        let owned = lock(&queue.partitions, PARTITIONS).len();
        queue.set_rate_share(owned);
    }
    Ok(())
}

/// Serves `partition` from `start` with `buffer` (assigned with `tpl`).
fn serve(
    queue: &QueueRuntime,
    partition: i32,
    start: i64,
    mut buffer: PartitionQueue,
    taking: &Taking<'_>,
    tpl: &mut TopicPartitionList,
) -> Result<()> {
    // The queue's settings now: a declaration may have changed them while it replayed.
    let (policy, max_lease_ms) = {
        let decl = queue.decl();
        (decl.policy(), decl.max_lease_ms)
    };
    let limited = !policy.limits.is_empty();
    buffer.set_policy(policy);
    buffer.set_slots(queue.slots(partition));
    if limited {
        // The previous owner's leases count against the limits until they end.
        let hold_ms = max_lease_ms.saturating_add(taking.member_timeout_ms);
        buffer.hold_until(now_ms().saturating_add(hold_ms));
        tracing::info!(queue = %queue.name, partition, hold_ms,
            "holding a limited partition until its previous owner's leases have ended");
    }
    lock(&queue.partitions, PARTITIONS).insert(partition, Arc::new(Mutex::new(buffer)));
    tpl.add_partition_offset(&queue.topic, partition, Offset::Offset(start))?;
    tracing::info!(queue = %queue.name, partition, start, "serving partition");
    Ok(())
}

/// Where each partition resumes: its committed offset, else its first record.
fn committed_offsets(consumer: &BaseConsumer, topic: &str, partitions: &[i32]) -> Result<Vec<i64>> {
    let mut tpl = TopicPartitionList::new();
    for &partition in partitions {
        tpl.add_partition(topic, partition);
    }
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(10))?;
    let mut starts = Vec::with_capacity(partitions.len());
    for &partition in partitions {
        match committed.find_partition(topic, partition).map(|e| e.offset()) {
            Some(Offset::Offset(offset)) => starts.push(offset),
            _ => starts.push(consumer.fetch_watermarks(topic, partition, Duration::from_secs(10))?.0),
        }
    }
    Ok(starts)
}

fn resume_drained(consumer: &BaseConsumer, broker: &Broker, paused: &mut HashSet<Key>) -> Result<()> {
    let mut resumed = Vec::new();
    for (name, partition) in paused.iter() {
        let Some(queue) = broker.queue(name) else { continue };
        let buffer = lock(&queue.partitions, PARTITIONS).get(partition).cloned();
        let has_room = buffer.is_none_or(|b| lock(&b, BUFFER).has_room(now_ms()));
        if has_room {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&queue.topic, *partition);
            consumer.resume(&tpl)?;
            resumed.push((name.clone(), *partition));
        }
    }
    for key in resumed {
        paused.remove(&key);
    }
    Ok(())
}

/// Commits every served partition's watermark; `releasing` (at shutdown) lets
/// each go first: it hands out and extends nothing more.
fn commit(consumer: &BaseConsumer, broker: &Broker, mode: CommitMode, releasing: bool) {
    let mut tpl = TopicPartitionList::new();
    for queue in broker.queues() {
        let partitions = lock(&queue.partitions, PARTITIONS);
        for (partition, buffer) in partitions.iter() {
            let offset = {
                let mut buffer = lock(buffer, BUFFER);
                if releasing {
                    buffer.retire();
                }
                buffer.commit_offset()
            };
            if let Err(err) = tpl.add_partition_offset(&queue.topic, *partition, Offset::Offset(offset)) {
                tracing::warn!(error = %err, queue = %queue.name, partition, offset, "not committing a watermark");
            }
        }
    }
    if tpl.count() > 0 {
        if let Err(err) = consumer.commit(&tpl, mode) {
            tracing::warn!(error = %err, "committing watermarks");
        }
    }
}

/// Reports lag (high watermark minus what was fetched) and the queue gauges every
/// second, on its own thread and client: broker round trips never hold up fetching.
pub fn spawn_reporter(
    config: &TallyConfig,
    broker: Arc<Broker>,
    shutdown: CancellationToken,
) -> Result<std::thread::JoinHandle<()>> {
    let client: BaseConsumer = client_config(&config.kafka)?.create()?;
    let peek = tally_shared::lag::Peek::new(&config.kafka)?;
    let group = config.broker.group_id.clone();
    // The (queue, partition) lags last reported: one no longer served is removed.
    let mut reported: HashSet<(String, String)> = HashSet::new();
    let thread = tally_shared::shutdown::every("broker-report", Duration::from_secs(1), shutdown, move || {
        let mut reporting = HashSet::new();
        for queue in broker.queues() {
            let (mut lag, mut ends) = (HashMap::new(), HashMap::new());
            let mut lags = Vec::new();
            for (partition, buffer) in queue.served() {
                let read = unfetched(client.client(), &queue.topic, (partition, &buffer), Duration::from_secs(2));
                if let Ok((high, unfetched)) = read {
                    lag.insert(partition, unfetched);
                    ends.insert(partition, high);
                    lags.push((partition as u32, high - unfetched, unfetched));
                }
            }
            // How old the oldest record not yet fetched is (kafka-lag-exporter's measure).
            let seconds = peek.seconds(&queue.topic, &lags);
            for (partition, _, records) in lags {
                let key = (queue.name.clone(), partition.to_string());
                let labels = [group.as_str(), key.0.as_str(), key.1.as_str()];
                broker.metrics.lag_records_by_partition.with_label_values(&labels).set(records);
                if let Some(seconds) = seconds.get(&partition).copied().flatten() {
                    broker.metrics.lag_seconds_by_partition.with_label_values(&labels).set(seconds);
                }
                reporting.insert(key);
            }
            let total: i64 = lag.values().sum();
            *lock(&queue.lag, LAG) = lag;
            *lock(&queue.ends, LAG) = ends;
            let name = &queue.name;
            let stats = broker.stats(&queue);
            broker.metrics.consumer_lag.with_label_values(&[name]).set(total);
            broker.metrics.depth.with_label_values(&[name]).set(stats.depth);
            broker.metrics.in_flight.with_label_values(&[name]).set(stats.in_flight as i64);
            broker.metrics.delayed.with_label_values(&[name]).set(stats.delayed as i64);
            broker.metrics.retrying.with_label_values(&[name]).set(stats.retrying as i64);
            let held = stats.partitions.iter().filter(|p| p.held_until.is_some()).count();
            broker.metrics.held_partitions.with_label_values(&[name]).set(held as i64);
            let oldest = stats.oldest_ready_age_ms.unwrap_or(0) as f64 / 1e3;
            broker.metrics.oldest_ready_age.with_label_values(&[name]).set(oldest);
            let slo = queue.decl().wait_slo_ms as f64 / 1e3;
            broker.metrics.wait_slo.with_label_values(&[name]).set(slo);
        }
        for (queue, partition) in reported.difference(&reporting) {
            let labels = [group.as_str(), queue.as_str(), partition.as_str()];
            broker.metrics.lag_records_by_partition.remove_label_values(&labels).ok();
            broker.metrics.lag_seconds_by_partition.remove_label_values(&labels).ok();
        }
        reported = reporting;
    })?;
    Ok(thread)
}

/// Refuses a job delayed further than its topic keeps it (`max_delay_ms`): it would
/// be lost to retention before it runs (or when a broker restarts from a committed
/// offset below it).
pub(crate) fn check_delay(job: Job, enqueued_at: i64, max_delay_ms: i64) -> std::result::Result<Job, String> {
    match job.run_at {
        Some(at) if at.saturating_sub(enqueued_at) > max_delay_ms => Err(format!(
            "run_at: {} ms after the job was enqueued, more than the {max_delay_ms} ms this queue's topic keeps \
             jobs (its retention_ms less a margin); enqueue it closer to its time or raise retention_ms",
            at.saturating_sub(enqueued_at),
        )),
        _ => Ok(job),
    }
}

/// Which rejected record a dead letter is for.
struct Letter {
    queue: String,
    partition: i32,
    offset: i64,
}

/// Collects the rejected records whose dead letter is acknowledged; the fetcher
/// finishes them (the callback never takes a buffer's lock).
#[derive(Default)]
struct LetterContext {
    written: Mutex<Vec<Letter>>,
}

impl LetterContext {
    /// Finishes the rejected records whose dead letters are written.
    fn finish_written(&self, broker: &Broker) {
        let written = {
            let mut written = lock(&self.written, WRITTEN);
            if written.is_empty() {
                return;
            }
            std::mem::take(&mut *written)
        };
        for letter in written {
            let Some(queue) = broker.queue(&letter.queue) else { continue };
            let buffer = lock(&queue.partitions, PARTITIONS).get(&letter.partition).cloned();
            if let Some(buffer) = buffer {
                lock(&buffer, BUFFER).finish_dead(letter.offset);
            }
        }
    }
}

impl ClientContext for LetterContext {}

impl ProducerContext for LetterContext {
    type DeliveryOpaque = Box<Letter>;

    fn delivery(&self, result: &DeliveryResult<'_>, letter: Self::DeliveryOpaque) {
        if let Err((err, _)) = result {
            // The record stays unfinished and its partition's watermark below it.
            tracing::error!(error = %err, queue = %letter.queue, partition = letter.partition, offset = letter.offset,
                "a dead letter (or a job forwarded to its key's partition) was not written; the partition's offset stays below it");
            return;
        }
        lock(&self.written, WRITTEN).push(*letter);
    }
}

/// Writes a job fetched outside its key's partition to `home`, as it was; the
/// record fetched here is finished once the copy is written ([`LetterContext`]).
fn forward(
    producer: &ThreadedProducer<LetterContext>,
    topic: &str,
    home: i32,
    message: &rdkafka::message::BorrowedMessage<'_>,
    letter: Letter,
) {
    let payload = message.payload().unwrap_or_default();
    let mut record = BaseRecord::with_opaque_to(topic, Box::new(letter)).partition(home).payload(payload);
    // It keeps its enqueue time: windows, delays and which of a key's jobs is newer
    // are the producer's.
    if let Some(at) = message.timestamp().to_millis().filter(|at| *at >= 0) {
        record = record.timestamp(at);
    }
    if let Some(key) = message.key() {
        record = record.key(key);
    }
    // And its trace.
    if let Some(headers) = message.headers().map(rdkafka::message::BorrowedHeaders::detach) {
        record = record.headers(headers);
    }
    send_retrying(producer, record, "a job forwarded to its key's partition");
}

/// Sends a record whose delivery finishes a held offset, waiting while the
/// producer's queue is full; a record it cannot send leaves the offset held.
fn send_retrying(
    producer: &ThreadedProducer<LetterContext>,
    mut record: BaseRecord<'_, [u8], [u8], Box<Letter>>,
    what: &str,
) {
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((err, returned)) if matches!(err.rdkafka_error_code(), Some(RDKafkaErrorCode::QueueFull)) => {
                record = returned;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err((err, _)) => {
                tracing::error!(error = %err, "cannot send {what}; the partition's offset stays below it");
                return;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn dead_letter(
    producer: &ThreadedProducer<LetterContext>,
    topic: &str,
    source_topic: &str,
    message: &rdkafka::message::BorrowedMessage<'_>,
    reason: &str,
    letter: Letter,
    budget: usize,
) {
    let raw = message.payload().unwrap_or_default();
    let encoded = DeadLetter::encode(source_topic, message.partition(), message.offset(), None, reason, raw, budget);
    let payload = match encoded {
        Ok(payload) => payload,
        Err(err) => {
            tracing::error!(error = %err, "cannot encode a dead letter; the partition's offset stays below it");
            return;
        }
    };
    let key = format!("{source_topic}/{}/{}", message.partition(), message.offset());
    let record = BaseRecord::with_opaque_to(topic, Box::new(letter)).key(key.as_bytes()).payload(&payload[..]);
    send_retrying(producer, record, "a dead letter");
}

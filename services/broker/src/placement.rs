//! Where a job lives, and what a broker taking a partition replays of it.
//!
//! A job of a unique key, or of a concurrency key on a per-key limited queue,
//! lives in its key's partition ([`tally_core::jobs::limits::partition_of`]): the
//! fetcher forwards one fetched elsewhere. A broker taking a partition of a queue
//! whose unique jobs hold their keys for a window replays the log's finished jobs
//! of that window, so it decides duplicates as its predecessors did.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::Message;
use tally_core::jobs::limits::{partition_of, Limits};
use tally_core::jobs::partition::PartitionQueue;
use tally_core::jobs::Job;
use tally_shared::kafka::{client_config, now_ms};

use crate::error::{Error, Result};
use crate::fetcher::check_delay;
use crate::state::QueueRuntime;

/// The partition a job lives in: its unique key's, or its concurrency key's on a
/// per-key limited queue (none: any); an error when the two differ. A schedule's
/// tick lives with its concurrency key's jobs when it has one (every tick of a
/// schedule has its payload, so its key), else in its schedule's partition.
pub fn home_partition(limits: &Limits, job: &Job, partitions: i32) -> std::result::Result<Option<i32>, String> {
    let limited = match limits.per_key_limited() {
        true => limits.key_of(job).ok().flatten().map(|key| partition_of(&key, partitions)),
        false => None,
    };
    let unique = match (&job.tick, &job.unique_key) {
        (Some(tick), _) => Some(
            limited.unwrap_or_else(|| partition_of(&tally_core::jobs::Tick::partition_key(&tick.schedule), partitions)),
        ),
        (None, Some(key)) => Some(partition_of(key, partitions)),
        (None, None) => None,
    };
    match (unique, limited) {
        (Some(unique), Some(limited)) if unique != limited => Err(format!(
            "unique_key and concurrency key live in different partitions ({unique} and {limited}): every job of a \
             key lives in its key's partition; give the job one of them, or the same key for both"
        )),
        (unique, limited) => Ok(unique.or(limited)),
    }
}

/// The partition a schedule's ticks live in, and its owner alone enqueues them.
pub fn schedule_partition(limits: &Limits, decl: &tally_shared::schedules::ScheduleDecl, partitions: i32) -> i32 {
    match home_partition(limits, &decl.job(0), partitions) {
        Ok(Some(partition)) => partition,
        _ => partition_of(&tally_core::jobs::Tick::partition_key(&decl.name), partitions),
    }
}

/// Replays the finished jobs of a partition whose unique keys may still be held
/// by their window — from `unique_for_ms` before the first unfinished job (or
/// now) up to the committed offset `start` — into `buffer`: the decisions the
/// previous owners made, made again. How many jobs it read.
pub fn replay_unique(
    kafka: &tally_shared::config::KafkaConfig,
    queue: &QueueRuntime,
    partition: i32,
    start: i64,
    buffer: &mut PartitionQueue,
) -> Result<usize> {
    let timeout = Duration::from_secs(30);
    let mut config = client_config(kafka)?;
    config.set("group.id", "tally-reader").set("enable.auto.commit", "false");
    let consumer: BaseConsumer = config.create()?;
    let (low, high) = consumer.fetch_watermarks(&queue.topic, partition, timeout)?;
    let policy = buffer.policy().clone();
    let partitions = queue.decl().partitions;
    // The first unfinished job's time (or now): a window that ended before it is
    // over for every job still to come.
    let mut first_unfinished = now_ms();
    if start < high {
        if let Some((_, at, _)) = read_range(&consumer, &queue.topic, partition, start, start + 1, timeout)?.first() {
            first_unfinished = first_unfinished.min(*at);
        }
    }
    let from_time = first_unfinished.saturating_sub(policy.unique_for_ms);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&queue.topic, partition, Offset::Offset(from_time))?;
    let found = consumer.offsets_for_times(tpl, timeout)?;
    let from = match found.find_partition(&queue.topic, partition).map(|e| e.offset()) {
        Some(Offset::Offset(offset)) => offset.max(low),
        _ => start,
    };
    let records = read_range(&consumer, &queue.topic, partition, from, start.min(high), timeout)?;
    let max_delay_ms = queue.decl().max_delay_ms();
    for (offset, at, payload) in &records {
        // Admitted as the fetch admits jobs: parsed, in time, allowed, at home.
        let Ok(job) = Job::parse(payload).and_then(|job| check_delay(job, *at, max_delay_ms)) else { continue };
        let home = home_partition(&policy.limits, &job, partitions);
        if policy.check(&job).is_ok() && (home == Ok(None) || home == Ok(Some(partition))) {
            buffer.replay_unique(*offset, &job, *at);
        }
    }
    Ok(records.len())
}

/// How many partitions a broker replays at once.
pub const REPLAYS_AT_ONCE: usize = 4;

/// A partition's buffer with the unique keys of its window replayed, ready to serve
/// from `start`.
pub struct Replayed {
    pub partition: i32,
    pub start: i64,
    pub buffer: PartitionQueue,
    /// How many records were read.
    pub records: usize,
}

/// The replays under way of the partitions a broker is taking, each on a thread of
/// its own: a window of many records holds up neither the fetching of the
/// partitions served nor the rounds that follow the membership.
#[derive(Default)]
pub struct Replays {
    running: HashMap<(String, i32), JoinHandle<Result<Replayed>>>,
    /// Replays of partitions let go before they ended: they count against the bound
    /// until their threads end.
    let_go: Vec<JoinHandle<Result<Replayed>>>,
}

impl Replays {
    pub fn is_replaying(&self, queue: &str, partition: i32) -> bool {
        self.running.contains_key(&(queue.to_string(), partition))
    }

    /// How many more may start now.
    pub fn room(&mut self) -> usize {
        self.let_go.retain(|thread| !thread.is_finished());
        REPLAYS_AT_ONCE.saturating_sub(self.running.len() + self.let_go.len())
    }

    /// Replays `partition` of `queue` up to `start` into `buffer`, on its own thread.
    pub fn start(
        &mut self,
        kafka: &tally_shared::config::KafkaConfig,
        queue: Arc<QueueRuntime>,
        partition: i32,
        start: i64,
        mut buffer: PartitionQueue,
    ) -> Result<()> {
        let kafka = kafka.clone();
        let key = (queue.name.clone(), partition);
        let replay = move || {
            let records = replay_unique(&kafka, &queue, partition, start, &mut buffer)?;
            Ok(Replayed { partition, start, buffer, records })
        };
        let thread = std::thread::Builder::new().name(format!("replay-{partition}")).spawn(replay)?;
        self.running.insert(key, thread);
        Ok(())
    }

    /// The replays of `queue` that ended (each an error if it failed); those of
    /// partitions no longer `desired` are let go, their threads ending on their own.
    pub fn finished(&mut self, queue: &str, desired: &[i32]) -> Vec<(i32, Result<Replayed>)> {
        let undesired: Vec<(String, i32)> = self
            .running
            .keys()
            .filter(|(name, partition)| name == queue && !desired.contains(partition))
            .cloned()
            .collect();
        for key in undesired {
            self.let_go.extend(self.running.remove(&key));
        }
        let ended: Vec<(String, i32)> = self
            .running
            .iter()
            .filter(|((name, _), thread)| name == queue && thread.is_finished())
            .map(|(key, _)| key.clone())
            .collect();
        let mut done = Vec::with_capacity(ended.len());
        for key in ended {
            if let Some(thread) = self.running.remove(&key) {
                let replayed =
                    thread.join().unwrap_or_else(|_| Err(Error::Broker("the replay's thread panicked".into())));
                done.push((key.1, replayed));
            }
        }
        done
    }
}

/// The records of `[from, until)` of one partition: offset, enqueue time, payload.
fn read_range(
    consumer: &BaseConsumer,
    topic: &str,
    partition: i32,
    from: i64,
    until: i64,
    timeout: Duration,
) -> Result<Vec<(i64, i64, Vec<u8>)>> {
    let mut records = Vec::new();
    if from >= until {
        return Ok(records);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(from))?;
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    while records.last().is_none_or(|(offset, _, _)| offset + 1 < until) {
        if Instant::now() >= deadline {
            let what = format!("{topic}/{partition}: could not read {from}..{until} in {timeout:?}");
            return Err(crate::Error::Broker(what));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) if message.offset() < until => {
                let at = message.timestamp().to_millis().filter(|ts| *ts >= 0).unwrap_or_else(now_ms);
                records.push((message.offset(), at, message.payload().unwrap_or_default().to_vec()));
            }
            Some(Ok(_)) => break,
            Some(Err(err)) => tracing::warn!(topic, partition, error = %err, "replaying unique keys"),
            None => {}
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use tally_core::jobs::limits::Limits;
    use tally_shared::schedules::ScheduleDecl;

    use super::*;

    fn schedule(payload: serde_json::Value) -> ScheduleDecl {
        serde_json::from_value(serde_json::json!({ "name": "nightly", "cron": "0 0 2 * * *", "payload": payload }))
            .unwrap()
    }

    #[test]
    fn a_tick_lives_with_its_concurrency_key_on_a_limited_queue_else_with_its_schedule() {
        let limited: Limits =
            serde_json::from_value(serde_json::json!({ "per_key": 1, "key_field": "tenant" })).unwrap();
        let partitions = 16;
        let own = partition_of(&tally_core::jobs::Tick::partition_key("nightly"), partitions);
        // Tenants whose partition is not the schedule's own.
        let tenants: Vec<String> =
            (0..50).map(|i| format!("t{i}")).filter(|t| partition_of(t, partitions) != own).take(3).collect();
        for tenant in &tenants {
            let decl = schedule(serde_json::json!({ "tenant": tenant }));
            let want = partition_of(tenant, partitions);
            assert_eq!(home_partition(&limited, &decl.job(7), partitions), Ok(Some(want)));
            assert_eq!(schedule_partition(&limited, &decl, partitions), want);
        }
        let keyless = schedule(serde_json::json!({ "report": "daily" }));
        assert_eq!(home_partition(&limited, &keyless.job(7), partitions), Ok(Some(own)));
        assert_eq!(schedule_partition(&limited, &keyless, partitions), own);
        let tenant = schedule(serde_json::json!({ "tenant": tenants[0] }));
        assert_eq!(schedule_partition(&Limits::default(), &tenant, partitions), own, "no per-key limit");
    }
}
